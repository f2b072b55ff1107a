"""The store's own byte buffers: the staging pool, the write-buffer budget, buffer views.

Adapters see staging buffers the store owns, or a caller's memory only when it is lent as an
``ObjectView``: a native adapter keeps raw pointers until it answers, which may be long after
a deadline handed the caller its buffer back. Puts are copied in once, at submission, so the
caller may reuse its memory at once; the budget bounds how many put bytes can be held that way.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from .object_format import stored_size


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


class WriteBudget:
    """Bytes of put staging alive at once (queued, with the adapter, or quarantined).

    Write-through is best effort: when storage is slower than the engine produces blocks, or
    stalls, refusing a put costs one future storage hit, while queueing it costs memory
    without bound. Thread-safe: callers reserve, the driver thread releases."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self._used = 0
        self._peak = 0
        self._lock = threading.Lock()

    def try_reserve(self, n: int, force: bool = False) -> bool:
        """Take `n` bytes if they fit (`force`: tiny internal probes that must not be refused)."""
        with self._lock:
            if not force and self._used + n > self.limit:
                return False
            self._used += n
            self._peak = max(self._peak, self._used)
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self._used -= n
            assert self._used >= 0, "write budget released more than reserved"

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        return self._peak


class ObjectView:
    """A get destination with room for the whole stored object (header, then payload, one
    contiguous buffer): the adapter reads straight into it and the store checks it in place,
    with no staging copy. The caller lends it: the adapter may write into it until the store
    gives it back (a result without ``held``, or the task id from ``take_released``)."""

    def __init__(self, buf: Any) -> None:
        self.buf = as_bytes(buf, writable=True)
        self.nbytes = self.buf.nbytes


def as_bytes(x: Any, writable: bool = False) -> Any:
    """Zero-copy flat uint8 view of a contiguous CPU tensor/array (any dtype) or bytes-like
    (an ``ObjectView`` passes through as it is)."""
    if isinstance(x, ObjectView):
        return x
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError("storage buffers must be contiguous CPU tensors")
        return x.detach().view(torch.uint8).reshape(-1).numpy()
    if isinstance(x, (bytes, bytearray, memoryview)):
        a = np.frombuffer(x, dtype=np.uint8)
    else:
        a = np.asarray(x)
        if not a.flags.c_contiguous:
            raise ValueError("storage buffers must be contiguous")
        a = a.reshape(-1).view(np.uint8)
    if writable and not a.flags.writeable:
        raise ValueError("storage destination buffers must be writable")
    return a


def as_segments(payload: Any) -> list[np.ndarray]:
    """A put payload is one buffer or a list/tuple of buffers stored back to back (e.g. the
    per-layer rows of one host slot, which then need no gathering copy of their own)."""
    if isinstance(payload, (list, tuple)):
        return [as_bytes(s) for s in payload]
    return [as_bytes(payload)]


def copy_segments(out: np.ndarray, segments: Sequence[np.ndarray]) -> None:
    """Concatenate `segments` into `out` (exactly their total size)."""
    off = 0
    for s in segments:
        out[off : off + s.nbytes] = s
        off += s.nbytes
    if off != out.nbytes:
        raise ValueError(f"segments hold {off} bytes, buffer is {out.nbytes}")


def by_size(sizes: Sequence[Hashable]) -> list[list[int]]:
    """Indices grouped by size (or any size-like key): LMCache's RESP client needs one object
    size per batch."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, n in enumerate(sizes):
        groups[n].append(i)
    return list(groups.values())


# Bytes per adapter load call. A task's loads are split so the CPU workers verify and copy
# the first objects while the adapter still reads the rest: with one call per task the
# whole read waits for its last byte before any check begins (measured: reads at 0.2x of
# plain file reads). Small enough to overlap, large enough that per-call costs (eventfd,
# bitmap, a driver wake-up) stay far below the copy (4 MiB ~ 0.4 ms at memory speed).
LOAD_CALL_BYTES = 4 << 20


def load_calls(idx: list[int], object_bytes: int) -> list[list[int]]:
    """`idx` (one object size) cut into adapter load calls of about `LOAD_CALL_BYTES`."""
    per_call = max(1, LOAD_CALL_BYTES // max(1, object_bytes))
    return [idx[i : i + per_call] for i in range(0, len(idx), per_call)]


def load_groups(dsts: Sequence[Any]) -> tuple[list[int], list[bool], list[list[int]]]:
    """A get's adapter load calls: each destination's object size (an `ObjectView` is read
    into, so it is the object; other buffers get staging with header room), whether it is
    lent, and the calls (indices of one size and kind, about `LOAD_CALL_BYTES` each)."""
    lent = [isinstance(d, ObjectView) for d in dsts]
    sizes = [d.nbytes if x else stored_size(d.nbytes) for d, x in zip(dsts, lent, strict=True)]
    groups = by_size(list(zip(sizes, lent, strict=True)))
    return sizes, lent, [part for g in groups for part in load_calls(g, sizes[g[0]])]
