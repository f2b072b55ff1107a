"""Every task the store accepted, from submission to its one reported result.

Callers submit and poll on their own threads; the driver and the CPU workers finish batches.
`TaskBook.finish` is the only place a result is reported, under the task's lock, so a task is
reported exactly once, never in the middle of a copy into its buffers, and always before the
release of views it lent (`LentViews`). Once `close_intake` ran no task is created, so
`fail_all` reaches every task that will ever exist.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import numpy as np

from .object_format import StorageKey
from .storage_records import (
    Batch,
    LentViews,
    OpKind,
    Task,
    TaskError,
    TaskResult,
    TaskState,
)

OnDone = Callable[[Task, TaskError | None], None]  # internal tasks (probes, clean-up)


class TaskBook:
    """Live tasks, finished results waiting for `poll`/`wait`, and views held past a result."""

    def __init__(self, on_put_failed: Callable[[], None]) -> None:
        # Told when a put fails with batches still open: its queued batches can be dropped.
        self._on_put_failed = on_put_failed
        self._ids = itertools.count()
        self._live: dict[int, Task] = {}
        self._live_lock = threading.Lock()
        self._accepting = True
        self._results: dict[int, TaskResult] = {}
        self._cv = threading.Condition()
        self.lent = LentViews()

    def new(self, op: OpKind, keys: list[StorageKey], dsts: list[np.ndarray] | None) -> Task:
        """A caller's task; raises once the store is closing."""
        task = self._add(Task(next(self._ids), op, keys, dsts, [False] * len(keys)))
        if task is None:
            raise RuntimeError("LMCacheStore is closed")
        return task

    def new_internal(
        self, op: OpKind, keys: list[StorageKey], dsts: list[np.ndarray] | None, on_done: OnDone
    ) -> Task | None:
        """A probe or clean-up task, reported to `on_done` only; None once the store is
        closing (such work is pointless then, and must not fail the step that asked)."""
        return self._add(Task(next(self._ids), op, keys, dsts, [False] * len(keys), on_done))

    def _add(self, task: Task) -> Task | None:
        with self._live_lock:
            if not self._accepting:
                return None
            self._live[task.id] = task
        return task

    def finish_now(self, task: Task, error: TaskError | None) -> int:
        self.finish(task, error)
        return task.id

    def batch_done(self, b: Batch, oks: list[bool]) -> None:
        """One batch of a running task answered; the last one finishes the task."""
        t = b.task
        if t.state is not TaskState.RUNNING:
            return
        for j, i in enumerate(b.idx):
            t.ok[i] = oks[j]
        t.open_batches -= 1
        if t.open_batches == 0:
            self.finish(t, None)

    def finish(self, t: Task, error: TaskError | None) -> bool:
        """Report `t` (once). False if it was already reported."""
        with t.lock:
            if t.finished:
                return False
            t.state = TaskState.EXPIRED if error is TaskError.DEADLINE else TaskState.DONE
            t.wait_no_copies()  # never hand back the caller's buffers mid-copy
            t.dsts = None
            t.held = t.lent > 0
            if error is not None:
                t.ok = [False] * len(t.ok)
            if t.on_done is None:  # still under t.lock: a release is announced after this
                if t.held:
                    self.lent.hold(t.id)
                with self._cv:
                    self._results[t.id] = TaskResult(
                        t.id, t.op, tuple(t.ok), error, t.held, finished_at=time.monotonic()
                    )
                    self._cv.notify_all()
        with self._live_lock:
            self._live.pop(t.id, None)
        if error is not None and t.op is OpKind.PUT and t.open_batches > 0:
            self._on_put_failed()
        if t.on_done is not None:
            t.on_done(t, error)
        return True

    def cancel(self, task_id: int) -> bool:
        """Finish a live task now (any thread). True if views it lent are still held."""
        with self._live_lock:
            task = self._live.get(task_id)
        if task is not None:
            self.finish(task, TaskError.CANCELLED)
        return self.lent.is_held(task_id)  # it may have been held since a deadline, too

    def poll(self) -> list[TaskResult]:
        if not self._results:  # the scheduler polls every step, most find nothing: no lock
            return []  # (a result added after this check is taken by the next poll)
        with self._cv:
            out = list(self._results.values())
            self._results.clear()
        return out

    def wait(self, task_id: int, timeout_s: float | None) -> TaskResult | None:
        with self._cv:
            self._cv.wait_for(lambda: task_id in self._results, timeout_s)
            return self._results.pop(task_id, None)

    def close_intake(self) -> None:
        """Create no task from now on (`new` raises)."""
        with self._live_lock:
            self._accepting = False

    def fail_all(self, error: TaskError) -> None:
        """Report every task not yet finished with `error` (after `close_intake`)."""
        self.close_intake()
        with self._live_lock:
            live = list(self._live.values())
        for t in live:
            self.finish(t, error)
