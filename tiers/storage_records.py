"""Plain records of the storage tier: op names, task states, results, counters.

These are the shapes that cross the store's thread boundaries (caller, driver, CPU workers)
and the only storage-tier types its callers see (`TaskResult`, `StoreStats`). No LMCache, no
threads, no I/O here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

import numpy as np

from .object_format import INVALID_REASONS, StorageKey


class OpKind(str, Enum):
    """What a task asks of storage (its value names the op in logs and metrics)."""

    PUT = "put"
    GET = "get"
    EXISTS = "exists"
    DELETE = "delete"


class TaskError(Enum):
    """Why a task failed as a whole (its per-key `ok` are then all False).

    Compare by member (`res.error is TaskError.BACKPRESSURE`): a misspelt member raises, where
    a misspelt string only compares unequal, and as a plain (not `str`) enum a comparison with
    a string is flagged by type checkers (mypy `--strict-equality`). `str()` gives the value,
    the word logs print."""

    BREAKER_OPEN = "breaker_open"  # storage judged broken: an immediate miss, nothing sent
    BACKPRESSURE = "backpressure"  # put refused: the write buffer is full (`write_buffer_mb`)
    DEADLINE = "deadline"  # the adapter did not answer within `op_deadline_s`
    ADAPTER = "adapter"  # the adapter raised on submit
    ADAPTER_RECREATED = "adapter_recreated"  # its adapter was replaced before it answered
    CLOSED = "closed"  # the store closed first
    CANCELLED = "cancelled"  # the caller gave the get up: nothing is written into it after

    def __str__(self) -> str:
        return self.value


class TaskState(Enum):
    QUEUED = "queued"  # accepted; not yet handed to the adapter (no deadline runs)
    RUNNING = "running"  # at least one of its batches is with the adapter
    DONE = "done"  # result reported
    EXPIRED = "expired"  # reported as DEADLINE; late adapter answers are ignored


class BatchKind(Enum):
    """The adapter call family of one batch (each has its own completion channel)."""

    STORE = "store"
    LOAD = "load"
    LOOKUP = "lookup"
    DELETE = "delete"


@dataclass(frozen=True)
class TaskResult:
    """Outcome of one submitted task. `ok[i]` is per key (put: stored, get: valid bytes copied
    into dst, exists: present, delete: gone); `error` is set when the task failed as a whole."""

    task_id: int
    op: OpKind
    ok: tuple[bool, ...]
    error: TaskError | None = None
    # get with `ObjectView` destinations: some are still lent to the adapter, which may write
    # into them until the task id comes back from `LMCacheStore.take_released()`.
    held: bool = False
    # time.monotonic() when the store finished it: latency metrics must not include the time
    # until the caller next polled (an idle engine polls late).
    finished_at: float = 0.0

    @property
    def num_ok(self) -> int:
        return sum(self.ok)


@dataclass
class StoreStats:
    """Monotonic counters, written by the store's driver thread (`puts_skipped` by the caller)."""

    put_objects: int = 0
    put_failed: int = 0
    puts_skipped: int = 0  # objects refused by backpressure (write buffer full): never queued
    bytes_written: int = 0
    get_hits: int = 0
    get_misses: int = 0
    bytes_read: int = 0
    exists_hits: int = 0
    exists_misses: int = 0
    invalid: dict[str, int] = field(default_factory=dict)  # header check failures by reason
    unreadable: int = 0  # present but not loadable at the exact size (truncated / resized)
    deleted_bad: int = 0  # invalid + unreadable objects deleted
    deadline_expired: int = 0
    slow_reports: int = 0  # `report_slow` calls (a request's wait on storage timed out)
    breaker_opens: int = 0
    adapter_recreations: int = 0
    probes_ok: int = 0
    probes_failed: int = 0

    def count_invalid(self, reason: str) -> None:
        self.invalid[reason] = self.invalid.get(reason, 0) + 1

    def as_metrics(self) -> dict[str, int]:
        """Flat name -> number, ready for a metrics exporter. Every known invalid reason is
        present (as `invalid_<reason>`, 0 if never seen) so exported series never appear late."""
        out: dict[str, int] = {}
        for f in fields(self):
            if f.name != "invalid":
                out[f.name] = int(getattr(self, f.name))
        for reason in (*INVALID_REASONS, *sorted(set(self.invalid) - set(INVALID_REASONS))):
            out[f"invalid_{reason}"] = self.invalid.get(reason, 0)
        return out


@dataclass(eq=False)
class Task:
    """One submitted op. A CPU worker registers in `copying` (under `lock`) before it writes a
    get's destination buffer, and `wait_no_copies` waits them out, so a deadline can
    never hand a buffer back in the middle of a copy; two workers still copy into one task's
    buffers at once (holding the lock for a whole copy would serialise them)."""

    id: int
    op: OpKind
    keys: list[StorageKey]
    dsts: list[np.ndarray] | None  # get only: the caller's buffers, released at finish
    ok: list[bool]
    on_done: Callable[[Task, TaskError | None], None] | None = None  # internal tasks
    lock: threading.RLock = field(default_factory=threading.RLock)
    state: TaskState = TaskState.QUEUED
    open_batches: int = 0
    copying: int = 0  # CPU workers writing into `dsts` right now
    lent: int = 0  # batches whose destinations the adapter reads into directly, not yet back
    held: bool = False  # reported while `lent` > 0: its release is announced

    def __post_init__(self) -> None:
        self._no_copies = threading.Condition(self.lock)

    @property
    def finished(self) -> bool:
        """Reported (or expired): late adapter answers change nothing."""
        return self.state in (TaskState.DONE, TaskState.EXPIRED)

    def start_copy(self) -> list[np.ndarray] | None:
        """The destinations to write, or None if the task is no longer live."""
        with self.lock:
            if self.state is not TaskState.RUNNING or self.dsts is None:
                return None
            self.copying += 1
            return self.dsts

    def end_copy(self) -> None:
        with self.lock:
            self.copying -= 1
            if self.copying == 0:
                self._no_copies.notify_all()

    def wait_no_copies(self) -> None:
        """Under `lock`, after `state` left RUNNING (so no copy starts): wait out the rest."""
        self._no_copies.wait_for(lambda: self.copying == 0)


@dataclass(eq=False)
class Batch:
    """One adapter call of a task (one object size: the RESP client needs equal sizes).

    `staging` belongs to the store and stays referenced until the adapter is done with it,
    even after the task was reported (native adapters keep raw pointers). The op deadline
    runs from `handed_at`, the moment the adapter got the call."""

    task: Task
    kind: BatchKind
    idx: list[int]  # positions in task.keys
    okeys: list[Any]  # LMCache ObjectKeys
    staging: list[np.ndarray] = field(default_factory=list)
    handed_at: float | None = None
    reserved: int = 0  # write-buffer bytes this batch holds (STORE only)
    lent: bool = False  # `staging` are the caller's `ObjectView`s, not the store's buffers


class LentViews:
    """Tasks reported while the adapter still held some of their `ObjectView`s, and those whose
    views all came back since. A task is marked held under its own lock when it is reported,
    and its release is decided under the same lock, so a release never precedes its report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._released: list[int] = []

    def hold(self, task_id: int) -> None:
        with self._lock:
            self._held.add(task_id)

    def is_held(self, task_id: int) -> bool:
        with self._lock:
            return task_id in self._held

    def back(self, t: Task) -> None:
        """One lent batch of `t` is no longer the adapter's."""
        with t.lock:
            t.lent -= 1
            released = t.lent == 0 and t.held
        if released:
            with self._lock:
                self._held.discard(t.id)
                self._released.append(t.id)

    def take_released(self) -> list[int]:
        with self._lock:
            out, self._released = self._released, []
        return out
