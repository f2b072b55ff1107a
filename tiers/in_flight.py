"""What the current adapter holds: its calls in flight, each a `Batch` of buffers it may write.

A native adapter keeps raw pointers into a batch's buffers until it answers, whatever happened
to the task meanwhile (a deadline, a cancel). So a batch leaves this ledger only when the
adapter answered, or when the adapter itself is closed or replaced, and `free` is the one way
its buffers go back: to the staging pool and the write budget, or, for views a caller lent,
to the caller through `LentViews`. Driver thread only (and the closing thread once the driver
stopped), so no lock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .staging import StagingPool, WriteBudget
from .storage_records import Batch, BatchKind, LentViews, TaskState


class InFlight:
    """Adapter call id -> its batch, for each call family."""

    def __init__(self, staging: StagingPool, budget: WriteBudget, lent: LentViews) -> None:
        self.staging, self.budget, self._lent = staging, budget, lent
        self._calls: dict[tuple[BatchKind, int], Batch] = {}

    def __bool__(self) -> bool:
        return bool(self._calls)

    def add(self, kind: BatchKind, call_id: int, b: Batch) -> None:
        """The adapter took `b`: its op deadline starts now."""
        b.handed_at = time.monotonic()
        self._calls[(kind, call_id)] = b
        if b.task.state is TaskState.QUEUED:
            b.task.state = TaskState.RUNNING

    def pop(self, kind: BatchKind, call_id: int) -> Batch | None:
        return self._calls.pop((kind, call_id), None)

    def holds(self, kind: BatchKind, call_id: int, b: Batch) -> bool:
        """Is `b` still this call's batch? (Not if its adapter was replaced meanwhile.)"""
        return self._calls.get((kind, call_id)) is b

    def call_ids(self, kind: BatchKind) -> list[int]:
        return [cid for k, cid in self._calls if k is kind]

    def count(self, kind: BatchKind) -> int:
        return sum(1 for k, _ in self._calls if k is kind)

    def batches(self) -> list[Batch]:
        return list(self._calls.values())

    def take_all(self) -> list[Batch]:
        """Forget every call (its adapter is closed or being replaced); the caller frees."""
        out = list(self._calls.values())
        self._calls.clear()
        return out

    def held_for_finished_tasks(self) -> int:
        """Buffers still with the adapter for tasks already reported (any thread: a copy)."""
        return sum(len(b.staging) for b in list(self._calls.values()) if b.task.finished)

    def free(self, batches: Sequence[Batch]) -> None:
        """Give back the buffers (and put budget) of batches no adapter holds any more."""
        for b in batches:
            if b.lent and b.staging:
                self._lent.back(b.task)
            elif b.staging:
                self.staging.put(b.staging)
            b.staging = []
            if b.reserved:
                self.budget.release(b.reserved)
                b.reserved = 0
