"""Block copies between vLLM's per-layer caches and the host slot pool.

vLLM hands each layer's cache as a tensor whose block axis is dim 0 (CPU,
Mamba pages, most layouts) or dim 1 (GPU ``[2, num_blocks, ...]`` K/V split).
Each layer is reduced to one or two *byte segments*: uint8 views
``[num_blocks, seg_bytes]`` over the cache's storage (K and V are two segments
in the split layout). A host slot row is the concatenation of a layer's
segments, so the stored bytes do not depend on the dtype view.

A batch becomes a ``CopyPlan``: runs of consecutive (block, slot) pairs per segment, so a
request whose blocks and slots are consecutive moves with one call per layer (host slots are
contiguous per slot, so on the host side a run is a strided set of rows). On CPU a run is a
numpy row or slice assignment (``host_copy``: a memcpy that releases the GIL; torch's
``index_select`` / ``index_copy_`` of uint8 rows move 0.2-0.6 GB/s on this build); on a GPU
the plan becomes pointer lists for one batched DMA call (``transfer_cuda``), pinned pool to
device memory without staging.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.host_copy import Runs, copy_rows, find_runs
from himamba.tiers.native_copy import native_row_copy, stream_min_bytes


def _byte_rows(t: torch.Tensor, num_blocks: int) -> torch.Tensor | None:
    """``t`` (block axis 0) as uint8 ``[num_blocks, block_bytes]``, or None if a block is not contiguous."""
    inner = t[0]
    if not inner.is_contiguous():
        return None
    es = t.element_size()
    nbytes = inner.numel() * es
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    raw.set_(
        t.untyped_storage(), t.storage_offset() * es, (num_blocks, nbytes), (t.stride(0) * es, 1)
    )
    return raw


@dataclass(frozen=True)
class LayerBlocks:
    name: str
    tensor: torch.Tensor
    block_dim: int
    block_bytes: int
    segments: tuple[torch.Tensor, ...]
    # numpy views of the same bytes when the cache lives in host memory.
    np_segments: tuple[np.ndarray, ...] | None = None

    @classmethod
    def wrap(cls, name: str, tensor: torch.Tensor, num_blocks: int) -> LayerBlocks:
        """Find the block axis and expose each block's bytes as row views."""
        if tensor.dim() >= 1 and tensor.shape[0] == num_blocks:
            block_dim, parts = 0, [tensor]
        elif tensor.dim() >= 2 and tensor.shape[1] == num_blocks and tensor.shape[0] == 2:
            block_dim, parts = 1, [tensor[0], tensor[1]]
        else:
            raise ValueError(
                f"layer {name}: cannot find the block axis of a cache of shape "
                f"{tuple(tensor.shape)} with {num_blocks} blocks"
            )
        segments = []
        for part in parts:
            rows = _byte_rows(part, num_blocks)
            if rows is None:
                raise ValueError(f"layer {name}: a block's bytes are not contiguous")
            segments.append(rows)
        nbytes = sum(s.shape[1] for s in segments)
        np_segments = tuple(s.numpy() for s in segments) if tensor.device.type == "cpu" else None
        return cls(name, tensor, block_dim, nbytes, tuple(segments), np_segments)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copies of the given blocks' bytes as ``[n, block_bytes]`` (for checks and tests)."""
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.tensor.device)
        return torch.cat([seg.index_select(0, idx) for seg in self.segments], dim=1)


def _runs(block_ids: Sequence[int], slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first block, first slot, count)`` for each stretch where both ids go up by one."""
    return find_runs(block_ids, slots).runs


class SegmentCopy(NamedTuple):
    """One run of rows between a cache segment and its columns of a pool row (the device path's
    unit; a tuple, as a random batch makes thousands of them)."""

    seg: torch.Tensor  # uint8 [num_blocks, seg_bytes] view of the cache
    np_seg: np.ndarray | None  # the same bytes as numpy when the cache is in host memory
    host: torch.Tensor  # uint8 [num_slots, seg_bytes] columns of the pool's layer rows
    np_host: np.ndarray
    block: int
    slot: int
    count: int


class SegmentRuns(NamedTuple):
    """One segment of one layer and the runs that move it; the runs object is shared by every
    layer with the same ids, so a plan costs a tuple per segment, not per row."""

    seg: torch.Tensor
    np_seg: np.ndarray | None
    host: torch.Tensor
    np_host: np.ndarray
    runs: Runs


class PlanCopies(Sequence[SegmentCopy]):
    """A plan's copies, one per (segment, run), made on demand: the host path never needs
    them, the device path walks them once, and ``len`` (the copy calls counted per job) is a
    sum over segments."""

    def __init__(self, segments: Sequence[SegmentRuns]) -> None:
        self._segments = segments
        self._len = sum(len(g.runs.runs) for g in segments)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[SegmentCopy]:
        for seg, np_seg, host, np_host, runs in self._segments:
            for b, s, n in runs.runs:
                yield SegmentCopy(seg, np_seg, host, np_host, b, s, n)

    def __getitem__(self, i: int) -> SegmentCopy:  # type: ignore[override]
        return list(self)[i]  # nobody indexes a plan on a hot path


@dataclass
class CopyPlan:
    """Every copy of one batch, in order, and the bytes it moves.

    Built on the caller's thread (ids are checked there, errors surface at once); run later on
    a copy thread (numpy row copies release the GIL) or as one pointer list on a GPU stream.
    """

    to_host: bool
    segments: list[SegmentRuns]
    nbytes: int
    rows: int = 0  # (block, segment) rows it moves; rows / len(copies) = mean run length

    @property
    def copies(self) -> PlanCopies:
        return PlanCopies(self.segments)

    def run_host(self) -> None:
        """Execute on the CPU, on this thread only (``host_copy``)."""
        to_host = self.to_host
        native = native_row_copy() if self.nbytes >= stream_min_bytes() else None
        if native is not None and all(g.np_seg is not None for g in self.segments):
            native.copy_segments(self.segments, to_host)
            return
        for g in self.segments:
            if g.np_seg is None:
                for b, s, n in g.runs.runs:
                    run_torch(SegmentCopy(g.seg, None, g.host, g.np_host, b, s, n), to_host)
            else:
                copy_rows(g.np_seg, g.np_host, g.runs, to_host)

    def pointer_lists(self) -> tuple[list[int], list[int], list[int]]:
        """``(src, dst, size)`` byte ranges for a batched copy (``swap_blocks_batch``); a run
        whose rows are contiguous on both sides is one range, else one range per row."""
        srcs: list[int] = []
        dsts: list[int] = []
        sizes: list[int] = []
        for c in self.copies:
            seg_bytes = c.seg.shape[1]
            cache0 = c.seg.data_ptr() + c.block * c.seg.stride(0)
            host0 = c.host.data_ptr() + c.slot * c.host.stride(0)
            dense = c.seg.stride(0) == seg_bytes and c.host.stride(0) == seg_bytes
            rows = [(0, c.count * seg_bytes)] if dense else [(i, seg_bytes) for i in range(c.count)]
            for i, size in rows:
                cache = cache0 + i * c.seg.stride(0)
                host = host0 + i * c.host.stride(0)
                srcs.append(cache if self.to_host else host)
                dsts.append(host if self.to_host else cache)
                sizes.append(size)
        return srcs, dsts, sizes


def run_torch(c: SegmentCopy, to_host: bool, non_blocking: bool = False) -> None:
    """Device-resident cache without the batched op (tests, benchmarks, fallback): torch
    slice copies."""
    cache_rows = c.seg[c.block : c.block + c.count]
    pool_rows = c.host[c.slot : c.slot + c.count]
    if to_host:
        pool_rows.copy_(cache_rows, non_blocking=non_blocking)
    else:
        cache_rows.copy_(pool_rows, non_blocking=non_blocking)


def plan_copies(
    layers: Sequence[LayerBlocks],
    layer_block_ids: Sequence[Sequence[int]],
    pool: HostSlotPool,
    slots: Sequence[int],
    to_host: bool,
) -> CopyPlan:
    """Block ``layer_block_ids[l][i]`` of layer l <-> slot ``slots[i]``, as runs of rows."""
    if len(layer_block_ids) != len(layers):
        raise ValueError(f"block ids for {len(layer_block_ids)} layers, expected {len(layers)}")
    segments: list[SegmentRuns] = []
    nbytes = rows = 0
    slots = pool.physical(slots)  # where the logical slots live now (cpu_pool.swap_out)
    runs_of: dict[tuple[int, ...], Runs] = {}  # layers of one KV group share their ids
    for li, (layer, ids) in enumerate(zip(layers, layer_block_ids, strict=True)):
        key = tuple(ids)
        runs = runs_of.get(key)
        if runs is None:
            runs = runs_of[key] = find_runs(key, slots)
        offset = 0
        for si, seg in enumerate(layer.segments):
            host, np_host = pool.columns(li, offset, offset + seg.shape[1])
            np_seg = None if layer.np_segments is None else layer.np_segments[si]
            segments.append(SegmentRuns(seg, np_seg, host, np_host, runs))
            offset += seg.shape[1]
        nbytes += layer.block_bytes * len(ids)
        rows += len(ids) * len(layer.segments)
    return CopyPlan(to_host, segments, nbytes, rows)


def device_to_host(
    layers: Sequence[LayerBlocks],
    layer_block_ids: Sequence[Sequence[int]],
    pool: HostSlotPool,
    slots: Sequence[int],
) -> int:
    """Copy block ``layer_block_ids[l][i]`` of layer l into slot ``slots[i]`` now; returns bytes."""
    plan = plan_copies(layers, layer_block_ids, pool, slots, to_host=True)
    plan.run_host()
    return plan.nbytes


def host_to_device(
    layers: Sequence[LayerBlocks],
    layer_block_ids: Sequence[Sequence[int]],
    pool: HostSlotPool,
    slots: Sequence[int],
) -> int:
    """Copy slot ``slots[i]`` into block ``layer_block_ids[l][i]`` of each layer l now."""
    plan = plan_copies(layers, layer_block_ids, pool, slots, to_host=False)
    plan.run_host()
    return plan.nbytes
