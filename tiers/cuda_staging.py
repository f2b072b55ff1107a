"""Whole-slot DMA for scattered blocks: gather on the device, then one copy per pool slot.

A plan's direct pointer lists hold one range per (block, segment) row whenever blocks are
scattered or a layer's rows are padded (Mamba pages: 36 KB of state in a 64 KB page). The DMA
engines pay several microseconds per range, so on an H200 such a batch moved at ~0.09x of a
plain pinned copy of the same bytes (docs/BENCHMARKS.md). Here a store gathers each segment's
rows on the device straight into a slot-shaped device buffer (one ``index_select`` per
segment, written into the slot columns, HBM speed), then copies each slot's covered columns
to the pinned pool in one range; a load does the reverse (one range per slot, then one
``index_copy_`` per segment). Only the columns the plan covers move: a plan over some layers
never touches the others, and slot headers (room for storage objects) are never written.

The fixed cost of a job is CPU time (Python and kernel launches), paid while the copy engine
waits for it, so what does not change between jobs is worked out once (``_Geometry``: the
column layout, and each segment seen through the widest integer type its alignment allows, so
the gather moves 8-byte words instead of bytes), and each distinct id list goes up once.

Everything is queued on the caller's stream (the copy engine's side stream): the staging
buffer is reused chunk after chunk in stream order, and index tensors go up through pinned
memory without blocking the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from himamba.tiers.transfer import CopyPlan

logger = logging.getLogger(__name__)

# The staging buffer's size: big enough that each chunk's DMA runs at full speed, small next
# to the KV cache vLLM sized the GPU for. A slot larger than this gets a buffer of one slot.
STAGING_BYTES = 128 << 20
# Stage when the direct lists would average fewer bytes per range than this.
STAGE_BELOW_BYTES_PER_RANGE = 1 << 20
# Geometries kept (one per distinct set of segments: a few per engine, one per KV group mix).
_GEOMETRIES = 64
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


@dataclass(frozen=True)
class _Geometry:
    """What a plan's segments look like, worked out once per set of segments."""

    # The tensors its key names, held so that their ids stay theirs while it is cached. The
    # copy engine that owns this cache is made per registration of vLLM's caches (the worker
    # holds those caches as long), so this holds nothing the worker would have let go.
    keep: tuple[torch.Tensor, ...]
    base: int  # the pool's address
    stride: int  # bytes per slot
    cols: list[tuple[int, int]]  # covered column ranges of a slot, merged
    segs: list[torch.Tensor]  # each segment's device rows, as its widest word
    words: list[tuple[int, int, torch.dtype]]  # (first word, last word, word type) in a slot
    # Per chunk length: each segment's columns of the buffer's first rows (made once: a
    # tensor slice per segment and job is a large part of a small job's CPU time).
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)


def _word(*values: int) -> tuple[int, torch.dtype]:
    """The widest integer type whose size divides every value (bytes otherwise)."""
    for size, dtype in _WORDS:
        if all(v % size == 0 for v in values):
            return size, dtype
    return 1, torch.uint8


def _work_out(plan: CopyPlan) -> _Geometry | None:
    """The plan's layout, or None when its host side is not one slot pool (then the direct
    lists are used)."""
    first = plan.segments[0].host
    base, stride = first.untyped_storage().data_ptr(), first.stride(0)
    cols, segs, words = [], [], []
    for g in plan.segments:
        h = g.host
        if h.untyped_storage().data_ptr() != base or h.stride(0) != stride or h.dim() != 2:
            return None
        off, width = h.data_ptr() - base, h.shape[1]
        if off < 0 or off + width > stride:
            return None
        cols.append((off, off + width))
        seg = g.seg
        # The device rows' address, row stride and width, and the slot column's offset (the
        # staging rows are one slot stride apart, 64-byte aligned) must all be whole words.
        size, dtype = _word(seg.data_ptr(), seg.storage_offset(), seg.stride(0), width, off, stride)
        if size > 1:
            try:
                seg = seg.view(dtype)
            except RuntimeError:  # a layout the dtype view refuses: bytes are always right
                size, dtype = 1, torch.uint8
        segs.append(seg)
        words.append((off // size, (off + width) // size, dtype))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(cols):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    keep = tuple(t for g in plan.segments for t in (g.seg, g.host))
    return _Geometry(keep, base, stride, merged, segs, words)


def _column_views(
    rows: torch.Tensor, words: list[tuple[int, int, torch.dtype]]
) -> list[torch.Tensor]:
    """Each segment's columns of ``rows`` (slot-shaped buffer rows), in its word type."""
    grids = {dtype: rows if dtype == torch.uint8 else rows.view(dtype) for _, _, dtype in words}
    return [grids[dtype][:, w0:w1] for w0, w1, dtype in words]


def _ids(plan: CopyPlan) -> tuple[list[list[int]], list[int], list[int]] | None:
    """(each distinct id list's block ids, each segment's list number, the slot list), or
    None if segments disagree on the slots. Segments of one KV group share their runs."""
    lists: list[list[int]] = []
    which: list[int] = []
    seen: dict[int, int] = {}
    slots: list[int] | None = None
    for g in plan.segments:
        key = id(g.runs)
        k = seen.get(key)
        if k is None:
            b_ids, s_ids = [], []
            for b, s, n in g.runs.runs:
                if n == 1:
                    b_ids.append(b)
                    s_ids.append(s)
                else:
                    b_ids.extend(range(b, b + n))
                    s_ids.extend(range(s, s + n))
            if slots is None:
                slots = s_ids
            elif s_ids != slots:
                return None
            k = seen[key] = len(lists)
            lists.append(b_ids)
        which.append(k)
    return (lists, which, slots) if slots is not None else None


def direct_ranges(plan: CopyPlan) -> int:
    """How many ranges the direct pointer lists would hold (``CopyPlan.pointer_lists``)."""
    total = 0
    # Segments of one KV group share one runs object: its row count is summed once, then
    # added for each segment that uses it.
    rows_of: dict[int, int] = {}
    for g in plan.segments:
        runs = g.runs
        seg_bytes = g.seg.shape[1]
        if g.seg.stride(0) == seg_bytes and g.host.stride(0) == seg_bytes:
            total += len(runs.runs)
            continue
        rows = rows_of.get(id(runs))
        if rows is None:
            rows = len(runs.runs) if runs.singles else sum(n for _, _, n in runs.runs)
            rows_of[id(runs)] = rows
        total += rows
    return total


def worth_staging(plan: CopyPlan) -> bool:
    """True when the direct lists would be many small ranges."""
    ranges = direct_ranges(plan)
    return ranges > 1 and plan.nbytes < ranges * STAGE_BELOW_BYTES_PER_RANGE


class DeviceStaging:
    """A slot-shaped device buffer and the staged issue of plans through it."""

    def __init__(self, device: torch.device, capacity_bytes: int = STAGING_BYTES) -> None:
        self._device = device
        self._capacity = capacity_bytes
        self._buf: torch.Tensor | None = None
        self._disabled = False
        self._geometries: dict[tuple[int, ...], _Geometry] = {}

    def _buffer(self, stride: int) -> torch.Tensor | None:
        """The buffer, allocated on first use on the current (copy) stream and kept (no
        cross-stream frees); None for good when the device has no room for it (vLLM sized
        its cache to the memory it was given): plans then go by their direct lists."""
        rows = max(1, self._capacity // stride)
        if self._buf is None or self._buf.numel() < rows * stride:
            if self._disabled:
                return None
            # Views of the old buffer must never be written again: the DMA reads the new one.
            for geo in self._geometries.values():
                geo.views.clear()
            try:
                self._buf = torch.empty(rows * stride, dtype=torch.uint8, device=self._device)
            except RuntimeError as exc:  # torch.OutOfMemoryError is one
                self._disabled = True
                logger.warning(
                    "himamba: no room for a %d-byte copy staging buffer (%s); "
                    "copies go by direct pointer lists",
                    rows * stride,
                    exc,
                )
                return None
        return self._buf

    def _geometry(self, plan: CopyPlan) -> _Geometry | None:
        key = tuple(id(t) for g in plan.segments for t in (g.seg, g.host))
        geo = self._geometries.get(key)
        if geo is None:
            geo = _work_out(plan)
            if geo is None:
                return None
            if len(self._geometries) >= _GEOMETRIES:
                self._geometries.clear()
            self._geometries[key] = geo
        return geo

    def issue(self, plan: CopyPlan, dma: Callable[[list[int], list[int], list[int]], None]) -> bool:
        """Queue ``plan`` staged on the current stream; False (nothing queued) when the plan's
        shape does not allow it. ``dma(src, dst, sizes)`` queues one batched copy."""
        if not plan.segments:
            return False
        geo, ids = self._geometry(plan), _ids(plan)
        if geo is None or ids is None:
            return False
        lists, which, slots = ids
        stride, base = geo.stride, geo.base
        buf = self._buffer(stride)
        if buf is None:
            return False
        per_chunk = max(1, buf.numel() // stride)
        n = len(slots)
        # Every distinct id list goes up in one copy (pinned on a GPU: no CPU wait).
        flat = lists[0] if len(lists) == 1 else [b for lst in lists for b in lst]
        idx_all = torch.tensor(flat, dtype=torch.int64)
        if self._device.type == "cuda":
            idx_all = idx_all.pin_memory().to(self._device, non_blocking=True)
        to_host = plan.to_host
        for c0 in range(0, n, per_chunk):
            c1 = min(n, c0 + per_chunk)
            k = c1 - c0
            rows = buf[: k * stride].view(k, stride)
            src, dst, sizes = [], [], []
            dev0 = rows.data_ptr()
            for i, slot in enumerate(slots[c0:c1]):
                dev, host = dev0 + i * stride, base + slot * stride
                for lo, hi in geo.cols:
                    src.append(dev + lo if to_host else host + lo)
                    dst.append(host + lo if to_host else dev + lo)
                    sizes.append(hi - lo)
            if not to_host:
                dma(src, dst, sizes)
            idx = [idx_all[j * n + c0 : j * n + c1] for j in range(len(lists))]
            views = geo.views.get(k)
            if views is None:
                views = geo.views[k] = _column_views(rows, geo.words)
            for seg, view, j in zip(geo.segs, views, which, strict=True):
                if to_host:
                    torch.index_select(seg, 0, idx[j], out=view)  # straight into the columns
                else:
                    seg.index_copy_(0, idx[j], view)
            if to_host:
                dma(src, dst, sizes)
        return True
