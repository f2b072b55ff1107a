"""Plain records and buffer helpers of the storage tier (no LMCache, no threads of their own).

Split from `lmcache_store` so the store file holds only the task life cycle; these are the
shapes that cross its thread boundaries (caller, driver, CPU workers).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .object_format import StorageKey


@dataclass(frozen=True)
class TaskResult:
    """Outcome of one submitted task. `ok[i]` is per key (put: stored, get: valid bytes copied
    into dst, exists: present, delete: gone). `error` says why a task failed as a whole:
    'breaker_open', 'deadline', 'adapter', 'adapter_recreated' or 'closed'."""

    task_id: int
    op: str
    ok: tuple[bool, ...]
    error: str | None = None

    @property
    def num_ok(self) -> int:
        return sum(self.ok)


@dataclass
class StoreStats:
    """Counters (monotonic) for metrics and tests."""

    put_objects: int = 0
    put_failed: int = 0
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
    breaker_opens: int = 0
    adapter_recreations: int = 0
    probes_ok: int = 0
    probes_failed: int = 0


@dataclass(eq=False)
class Task:
    """One submitted op. `lock` is held while a worker reads/writes the caller's buffers, so a
    deadline can never hand a buffer back to the caller in the middle of a copy."""

    id: int
    op: str
    keys: list[StorageKey]
    bufs: list[np.ndarray] | None
    deadline: float
    ok: list[bool]
    on_done: Callable[[Task, str | None], None] | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    state: str = "new"  # new | running | done | expired
    open_batches: int = 0


@dataclass(eq=False)
class Batch:
    """One adapter call (one object size) of a task."""

    task: Task
    idx: list[int]
    okeys: list[Any]
    staging: list[np.ndarray]  # referenced until the adapter is done with them


class StagingPool:
    """Reuses exact-size buffers: fresh ones page-fault on first touch (slower than the copy)."""

    def __init__(self, max_bytes: int) -> None:
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)
        self._bytes, self._max, self._lock = 0, max_bytes, threading.Lock()

    def get(self, n: int) -> np.ndarray:
        with self._lock:
            if self._free.get(n):
                self._bytes -= n
                return self._free[n].pop()
        return np.empty(n, dtype=np.uint8)

    def put(self, bufs: Sequence[np.ndarray]) -> None:
        with self._lock:
            for b in bufs:
                if self._bytes + b.nbytes <= self._max:
                    self._free[b.nbytes].append(b)
                    self._bytes += b.nbytes


def as_bytes(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """Zero-copy flat uint8 view of a contiguous CPU tensor/array (any dtype)."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError("storage buffers must be contiguous CPU tensors")
        return x.detach().view(torch.uint8).reshape(-1).numpy()
    a = np.asarray(x)
    if not a.flags.c_contiguous:
        raise ValueError("storage buffers must be contiguous")
    return a.reshape(-1).view(np.uint8)


def by_size(bufs: Sequence[np.ndarray]) -> list[list[int]]:
    """Indices grouped by size: LMCache's RESP client needs one object size per batch."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, b in enumerate(bufs):
        groups[b.nbytes].append(i)
    return list(groups.values())
