"""The storage task pipeline: from a caller's submit to its `TaskResult`.

Its parts, each in its own module:

* `task_book.TaskBook`: live tasks and their one reported result (any thread);
* `in_flight.InFlight`: the batches the adapter holds, and the one way their buffers go back;
* `put_path.PutPath`: staging, sealing, the put queue, store completions;
* `get_path.GetPath`: loads and their validation, lookups, deletes.

Tasks are split into batches of one object size (LMCache's RESP client rejects mixed sizes
and desyncs after). A batch's deadline runs from the moment the adapter gets it, so a backlog
in the checksum workers or the put queue never reads as slow storage. Everything except
`submit*`, `poll`, `wait` and `cancel` (caller threads) and the sealing/validation jobs (CPU
workers) runs on the store's driver thread. Whether the adapter may be used, and which adapter
that is, is decided by `AdapterHealth`; the pipeline only reports outcomes to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .adapter_health import AdapterHealth
from .get_path import GetPath
from .in_flight import InFlight
from .lmcache_shapes import LMCacheShapes
from .object_format import Namespace, StorageKey, resolve_algo
from .pipeline_parts import PipelineParts
from .put_path import PutPath
from .staging import StagingPool, WriteBudget
from .storage_config import StorageConfig
from .storage_records import Batch, LentViews, OpKind, StoreStats, TaskError, TaskResult, TaskState
from .task_book import OnDone, TaskBook
from .thread_priority import initializer


class TaskPipeline:
    """Submission, batching, adapter calls, validation, deadlines and completion of tasks."""

    def __init__(
        self,
        cfg: StorageConfig,
        namespace: Namespace,
        health: AdapterHealth,
        stats: StoreStats,
        post: Callable[[Callable[[], None]], None],
    ) -> None:
        self.cfg, self.stats, self._health = cfg, stats, health
        self.shapes = LMCacheShapes(namespace)
        algo = resolve_algo(cfg.checksum)
        self.budget = WriteBudget(cfg.write_buffer_mb << 20)
        background = initializer(cfg.thread_nice)
        self._cpu = ThreadPoolExecutor(
            cfg.num_workers, thread_name_prefix="himamba-l3-cpu", initializer=background
        )
        self._deleter = ThreadPoolExecutor(
            1, thread_name_prefix="himamba-l3-del", initializer=background
        )
        # The callback runs only once tasks exist, by when `_puts` does too.
        self.book = TaskBook(on_put_failed=lambda: self._puts.sweep_later())
        self.calls = InFlight(StagingPool(cfg.staging_pool_mb << 20), self.budget, self.book.lent)
        parts = PipelineParts(
            namespace, algo, self.shapes, self.book, self.calls, health, stats, self._cpu, post
        )
        self._puts = PutPath(cfg, parts)
        self._gets = GetPath(parts, self._deleter)

    @property
    def lent(self) -> LentViews:
        """Tasks reported while the adapter still held views they lent."""
        return self.book.lent

    # ------------------------------------------------------------------ caller threads
    def submit_put(self, keys: Sequence[StorageKey], payloads: Sequence[Any]) -> int:
        return self._puts.submit(keys, payloads)

    def submit_put_later(
        self, keys: Sequence[StorageKey], payloads: Sequence[Any]
    ) -> tuple[int, Callable[[], None] | None]:
        return self._puts.submit_later(keys, payloads)

    def submit(self, op: OpKind, keys: Sequence[StorageKey], dsts: Sequence[Any] | None) -> int:
        """get (into `dsts`, each exactly the payload size), exists or delete."""
        return self._gets.submit(op, keys, dsts)

    def cancel(self, task_id: int) -> bool:
        """Finish a live task now (any thread): copies into its destinations that already
        started are waited out, none starts after, so the caller may reuse them at once.
        True if some were `ObjectView`s still lent to the adapter (released later)."""
        return self.book.cancel(task_id)

    def poll(self) -> list[TaskResult]:
        return self.book.poll()

    def wait(self, task_id: int, timeout_s: float | None) -> TaskResult | None:
        return self.book.wait(task_id, timeout_s)

    # ------------------------------------------------------------------ driver thread
    def submit_internal(
        self,
        op: OpKind,
        keys: list[StorageKey],
        bufs: list[np.ndarray] | None,
        on_done: OnDone,
    ) -> None:
        """Health probes, verification and clean-up: they bypass the breaker and the queue
        (and are not started once the store closes)."""
        if op is OpKind.PUT:
            assert bufs is not None
            self._puts.put_internal(keys, bufs, on_done)
        else:
            self._gets.start_internal(op, keys, bufs, on_done)

    def collect(self) -> None:
        """Take the adapter's finished calls (after its eventfds fired)."""
        ad = self._health.adapter
        if ad is None or not self.calls:
            return
        now = time.monotonic()
        self._puts.collect(ad, now)
        self._gets.collect(ad, now)

    def dispatch_puts(self) -> None:
        self._puts.dispatch()

    def expire(self, now: float) -> None:
        """Fail tasks whose adapter call outlived `op_deadline_s`; their batches stay in flight
        (quarantined) until the adapter answers or is replaced."""
        for b in self.calls.batches():
            t = b.task
            if (
                t.state is not TaskState.RUNNING
                or now - (b.handed_at or now) < self.cfg.op_deadline_s
            ):
                continue
            if not t.lock.acquire(blocking=False):
                continue
            try:
                if t.copying:
                    continue  # a worker is mid-copy into its dst: next round
                expired = self.book.finish(t, TaskError.DEADLINE)
            finally:
                t.lock.release()
            if expired:
                self.stats.deadline_expired += 1
                self._health.outcome(False, f"{t.op.value} deadline")

    # ------------------------------------------------------------------ buffers
    def free_batches(self, batches: Sequence[Batch]) -> None:
        """Return buffers (and put budget) of batches no adapter holds any more."""
        self.calls.free(batches)

    def detach_batches(self) -> list[Batch]:
        """The adapter is being replaced: fail its tasks, hand over its batches (with their
        buffers) to be freed once it is closed. Queued puts were never given to it: kept."""
        batches = self.calls.take_all()
        for b in batches:
            if b.task.state is TaskState.RUNNING:
                self.book.finish(b.task, TaskError.ADAPTER_RECREATED)
        return batches

    def held_for_finished_tasks(self) -> int:
        """Buffers still with the current adapter for tasks already reported."""
        return self.calls.held_for_finished_tasks()

    @property
    def puts_queued(self) -> int:
        return self._puts.queued

    # ------------------------------------------------------------------ closing, in order
    def close_intake(self) -> None:
        """Accept no submission from now on (they raise)."""
        self.book.close_intake()

    def stop_workers(self) -> None:
        """Let the CPU workers finish (the driver has stopped: what they post runs inline)."""
        self.book.close_intake()
        self._cpu.shutdown(wait=True, cancel_futures=True)

    def delete_probe_key(self, key: StorageKey, timeout_s: float) -> None:
        """Best effort at close (at interpreter exit the executor refuses new work)."""
        try:
            fut = self._deleter.submit(self._health.adapter.delete, [self.shapes.object_key(key)])
            fut.result(timeout=timeout_s)
        except Exception:
            pass

    def fail_unfinished(self) -> None:
        """Report every task not yet finished as CLOSED."""
        self._deleter.shutdown(wait=False, cancel_futures=True)
        self.book.fail_all(TaskError.CLOSED)

    def release_pending(self) -> None:
        """The adapter is closed: nothing it held is written any more, and nothing queued will
        reach it. Frees every buffer the pipeline still holds."""
        self.calls.free(self.calls.take_all())
        self._puts.drop_queue()
