"""Whole-slot DMA for scattered blocks: gather on the device, then one copy per pool slot.

A plan's direct pointer lists hold one range per (block, segment) row whenever blocks are
scattered or a layer's rows are padded (Mamba pages: 36 KB of state in a 64 KB page). The DMA
engines pay several microseconds per range, so on an H200 such a batch moved at ~0.09x of a
plain pinned copy of the same bytes (docs/BENCHMARKS.md). Here a store gathers each segment's
rows on the device (``index_select``, HBM speed) into a slot-shaped device buffer laid out
like the pool's slots, then copies each slot's covered columns to the pinned pool in one
range; a load does the reverse (one range per slot, then ``index_copy_`` per segment).
Only the columns the plan covers move: a plan over some layers never touches the others,
and slot headers (room for storage objects) are never written.

Everything is queued on the caller's stream (the copy engine's side stream): the staging
buffer is reused chunk after chunk in stream order, and index tensors go up through pinned
memory without blocking the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from himamba.tiers.transfer import CopyPlan

logger = logging.getLogger(__name__)

# The staging buffer's size: big enough that each chunk's DMA runs at full speed, small next
# to the KV cache vLLM sized the GPU for. A slot larger than this gets a buffer of one slot.
STAGING_BYTES = 128 << 20
# Stage when the direct lists would average fewer bytes per range than this.
STAGE_BELOW_BYTES_PER_RANGE = 1 << 20


def _columns(plan: CopyPlan) -> tuple[int, int, list[tuple[int, int]]] | None:
    """(pool base address, slot stride, merged covered column ranges), or None when the
    plan's host side is not one slot pool (then the direct lists are used)."""
    first = plan.segments[0].host
    base, stride = first.untyped_storage().data_ptr(), first.stride(0)
    cols = []
    for g in plan.segments:
        h = g.host
        if h.untyped_storage().data_ptr() != base or h.stride(0) != stride or h.dim() != 2:
            return None
        off = h.data_ptr() - base
        if off < 0 or off + h.shape[1] > stride:
            return None
        cols.append((off, off + h.shape[1]))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(cols):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return base, stride, merged


def _expand(plan: CopyPlan) -> tuple[list[list[int]], list[int]] | None:
    """Per segment its block ids, and the plan's slot list (None if segments disagree)."""
    blocks: list[list[int]] = []
    slots: list[int] | None = None
    seen: dict[int, tuple[list[int], list[int]]] = {}
    for g in plan.segments:
        key = id(g.runs)
        if key not in seen:
            b_ids, s_ids = [], []
            for b, s, n in g.runs.runs:
                b_ids.extend(range(b, b + n))
                s_ids.extend(range(s, s + n))
            seen[key] = (b_ids, s_ids)
        b_ids, s_ids = seen[key]
        if slots is None:
            slots = s_ids
        elif s_ids != slots:
            return None
        blocks.append(b_ids)
    return (blocks, slots) if slots is not None else None


def direct_ranges(plan: CopyPlan) -> int:
    """How many ranges the direct pointer lists would hold (``CopyPlan.pointer_lists``)."""
    total = 0
    for g in plan.segments:
        seg_bytes = g.seg.shape[1]
        dense = g.seg.stride(0) == seg_bytes and g.host.stride(0) == seg_bytes
        total += len(g.runs.runs) if dense else sum(n for _, _, n in g.runs.runs)
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

    def _buffer(self, stride: int) -> torch.Tensor | None:
        """The buffer, allocated on first use on the current (copy) stream and kept (no
        cross-stream frees); None for good when the device has no room for it (vLLM sized
        its cache to the memory it was given): plans then go by their direct lists."""
        rows = max(1, self._capacity // stride)
        if self._buf is None or self._buf.numel() < rows * stride:
            if self._disabled:
                return None
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

    def issue(self, plan: CopyPlan, dma: Callable[[list[int], list[int], list[int]], None]) -> bool:
        """Queue ``plan`` staged on the current stream; False (nothing queued) when the plan's
        shape does not allow it. ``dma(src, dst, sizes)`` queues one batched copy."""
        if not plan.segments:
            return False
        geometry, ids = _columns(plan), _expand(plan)
        if geometry is None or ids is None:
            return False
        base, stride, cols = geometry
        blocks, slots = ids
        buf = self._buffer(stride)
        if buf is None:
            return False
        per_chunk = max(1, buf.numel() // stride)
        # All index lists go up in one pinned copy, sliced per segment on the device.
        flat = [b for lst in blocks for b in lst]
        idx_all = torch.tensor(flat, dtype=torch.int64)
        if self._device.type == "cuda":  # pinned: the upload does not block the CPU
            idx_all = idx_all.pin_memory().to(self._device, non_blocking=True)
        n = len(slots)
        for c0 in range(0, n, per_chunk):
            c1 = min(n, c0 + per_chunk)
            rows = buf[: (c1 - c0) * stride].view(c1 - c0, stride)
            src, dst, sizes = [], [], []
            for i, slot in enumerate(slots[c0:c1]):
                for lo, hi in cols:
                    dev = rows.data_ptr() + i * stride + lo
                    host = base + slot * stride + lo
                    src.append(host if not plan.to_host else dev)
                    dst.append(dev if not plan.to_host else host)
                    sizes.append(hi - lo)
            if not plan.to_host:
                dma(src, dst, sizes)
            for gi, g in enumerate(plan.segments):
                off = g.host.data_ptr() - base
                view = rows[:, off : off + g.host.shape[1]]
                start = gi * n
                idx = idx_all[start + c0 : start + c1]
                if plan.to_host:
                    # Gather, then place in the slot columns: the form checked on an H200.
                    view.copy_(g.seg.index_select(0, idx))
                else:
                    g.seg.index_copy_(0, idx, view)
            if plan.to_host:
                dma(src, dst, sizes)
        return True
