"""Asynchronous copies between vLLM's caches and the host pool: submit a batch, get a job id,
poll completions. One contract, two backends.

``HostCopyEngine`` (CPU caches) runs every job, in submission order, on one copy thread: numpy
slice copies release the GIL, so the engine's own thread keeps scheduling and computing while
bytes move. ``transfer_cuda.CudaCopyEngine`` (GPU caches) issues the same plans as one batched
DMA call on a side stream and completes them by CUDA events.

What makes the asynchrony safe is the caller's contract (``connector.worker_side``): a job is
done before its host slots are read (storage writes, loads of the same slot run after it on the
same FIFO), and stores are fenced before the next step can overwrite a source block.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from himamba.tiers.transfer import CopyPlan

logger = logging.getLogger(__name__)


@dataclass
class JobResult:
    job_id: int
    ok: bool
    error: str = ""
    seconds: float = 0.0  # time the copies themselves took


class CopyEngine(Protocol):
    """What the worker needs of a backend (``HostCopyEngine``, ``CudaCopyEngine``)."""

    # True where copies run beside the compute (a GPU's side stream): the device orders block
    # reuse, so the worker never has to block the CPU for it.
    overlaps_compute: bool

    def submit(self, plans: Sequence[CopyPlan]) -> int: ...
    def done(self, job_id: int) -> bool: ...
    def wait(self, job_ids: Iterable[int] | None = None) -> None: ...
    def collect(self, job_ids: Iterable[int]) -> list[JobResult]: ...
    def pending(self) -> int: ...
    def close(self) -> None: ...


@dataclass
class _Job:
    job_id: int
    plans: Sequence[CopyPlan]
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""
    seconds: float = 0.0


class HostCopyEngine:
    """A FIFO copy thread. ``submit`` never blocks; ``wait`` blocks until the given jobs ran."""

    overlaps_compute = False  # on CPU the forward and the copies share the same cores

    def __init__(self, name: str = "himamba-copy") -> None:
        self._next_id = 0
        self._jobs: dict[int, _Job] = {}
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, plans: Sequence[CopyPlan]) -> int:
        """Queue the plans as one job; they run after every job submitted before."""
        if self._closed:
            raise RuntimeError("copy engine is closed")
        with self._lock:
            self._next_id += 1
            job = _Job(self._next_id, plans)
            self._jobs[job.job_id] = job
        self._queue.put(job)
        return job.job_id

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            start = time.perf_counter()
            try:
                for plan in job.plans:
                    plan.run_host()
            except Exception as exc:  # noqa: BLE001 - a failed copy fails its job, not the thread
                job.error = f"{type(exc).__name__}: {exc}"
                logger.warning("himamba: copy job %d failed: %s", job.job_id, job.error)
            job.seconds = time.perf_counter() - start
            job.done.set()

    def done(self, job_id: int) -> bool:
        job = self._jobs.get(job_id)
        return job is None or job.done.is_set()

    def wait(self, job_ids: Iterable[int] | None = None) -> None:
        """Block until the given jobs (default: all submitted so far) have run."""
        with self._lock:
            jobs = list(self._jobs.values()) if job_ids is None else []
            if job_ids is not None:
                jobs = [self._jobs[j] for j in job_ids if j in self._jobs]
        for job in jobs:
            job.done.wait()

    def collect(self, job_ids: Iterable[int]) -> list[JobResult]:
        """Results of the given jobs that have finished; they are forgotten once collected."""
        out = []
        with self._lock:
            for j in job_ids:
                job = self._jobs.get(j)
                if job is not None and job.done.is_set():
                    del self._jobs[j]
                    out.append(JobResult(j, not job.error, job.error, job.seconds))
        return out

    def pending(self) -> int:
        with self._lock:
            return sum(1 for j in self._jobs.values() if not j.done.is_set())

    def close(self) -> None:
        """Finish what was submitted, then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()


def make_copy_engine(on_cuda: bool) -> CopyEngine:
    """The CUDA engine for device caches (when vLLM's batched copy op or torch can drive it),
    the copy thread otherwise."""
    if on_cuda:
        from himamba.tiers.transfer_cuda import CudaCopyEngine  # noqa: PLC0415 (needs CUDA)

        return CudaCopyEngine()
    return HostCopyEngine()
