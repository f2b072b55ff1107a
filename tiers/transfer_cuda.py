"""The GPU backend of the copy engine: pinned pool <-> device blocks by DMA on a side stream.

A job is one batched driver call (vLLM's ``_custom_ops.swap_blocks_batch``: pointer lists,
``cuMemcpyBatchAsync`` on CUDA 12.8+) per plan, on a dedicated stream that first waits for
everything already queued on the compute stream (the forward that wrote the blocks a store
reads; the zeroing that precedes a load's destination). Completion is a CUDA event, polled.

Scattered blocks and padded rows (Mamba pages) would make the lists thousands of small ranges,
which the DMA engines move at a tenth of their speed; such plans are gathered on the device
into whole slots first (``cuda_staging``), one range per slot.

Stores also make the compute stream wait for their event. That is the fence: whatever vLLM
schedules next (a freed source block reused by another request, zeroed, or a preempted
request's blocks rewritten) runs on the compute stream after the copy, while the CPU never
blocks. The pool is pinned once at start-up (``HostSlotPool(pin=True)``): no pageable staging
and no ``.pin_memory()`` on the path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from himamba.tiers.cuda_staging import DeviceStaging, worth_staging
from himamba.tiers.transfer import CopyPlan, run_torch
from himamba.tiers.transfer_engine import JobResult

logger = logging.getLogger(__name__)


def _batched_copy_op() -> Callable[..., None] | None:
    """vLLM's batched copy, when this vLLM build has it (0.32+ CUDA builds do)."""
    try:
        from vllm import _custom_ops as ops  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - no vLLM, or a build without the op: torch copies
        return None
    return getattr(ops, "swap_blocks_batch", None)


class CudaCopyEngine:
    """Same contract as ``HostCopyEngine``: submit -> job id, ``collect`` finished jobs."""

    overlaps_compute = True

    def __init__(
        self, device: torch.device | None = None, batched: bool = True, staged: bool = True
    ) -> None:
        self._device = device or torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(device=self._device)
        self._op = _batched_copy_op() if batched else None
        # Scattered or padded rows go through a device buffer, one DMA range per slot.
        self.staging: DeviceStaging | None = DeviceStaging(self._device) if staged else None
        self._next_id = 0
        # job id -> (start event, end event, error)
        self._jobs: dict[int, tuple[torch.cuda.Event, torch.cuda.Event, str]] = {}
        self._closed = False

    def submit(self, plans: Sequence[CopyPlan]) -> int:
        if self._closed:
            raise RuntimeError("copy engine is closed")
        compute = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(compute)
        error = ""
        start, event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start.record(self._stream)
            try:
                for plan in plans:
                    self._issue(plan)
            except Exception as exc:  # noqa: BLE001 - the job fails, the engine goes on
                error = f"{type(exc).__name__}: {exc}"
                logger.warning("himamba: GPU copy failed: %s", error)
            event.record(self._stream)
        if any(p.to_host for p in plans):
            compute.wait_event(event)  # later kernels cannot overwrite a block being read
        self._next_id += 1
        self._jobs[self._next_id] = (start, event, error)
        return self._next_id

    def _issue(self, plan: CopyPlan) -> None:
        if self._op is None:
            for c in plan.copies:
                run_torch(c, plan.to_host, non_blocking=True)
            return
        if self.staging is not None and worth_staging(plan) and self.staging.issue(plan, self._dma):
            return
        self._dma(*plan.pointer_lists())

    def _dma(self, src: list[int], dst: list[int], sizes: list[int]) -> None:
        """One batched copy of raw ranges on the current stream."""
        if src and self._op is not None:
            self._op(_ptrs(src), _ptrs(dst), _ptrs(sizes))

    def done(self, job_id: int) -> bool:
        job = self._jobs.get(job_id)
        return job is None or job[1].query()

    def wait(self, job_ids: Iterable[int] | None = None) -> None:
        ids = list(self._jobs) if job_ids is None else list(job_ids)
        for j in ids:
            job = self._jobs.get(j)
            if job is not None:
                job[1].synchronize()

    def collect(self, job_ids: Iterable[int]) -> list[JobResult]:
        out = []
        for j in job_ids:
            job = self._jobs.get(j)
            if job is not None and job[1].query():
                del self._jobs[j]
                seconds = job[0].elapsed_time(job[1]) / 1000
                out.append(JobResult(j, not job[2], job[2], seconds))
        return out

    def pending(self) -> int:
        return sum(1 for _, ev, _ in self._jobs.values() if not ev.query())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stream.synchronize()


def _ptrs(values: list[int]) -> Any:
    return torch.tensor(values, dtype=torch.int64)
