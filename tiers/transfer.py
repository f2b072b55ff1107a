"""Block copies between vLLM's per-layer caches and the host slot pool.

vLLM hands each layer's cache as a tensor whose block axis is dim 0 (CPU,
Mamba pages, most layouts) or dim 1 (GPU ``[2, num_blocks, ...]`` K/V split).
Each layer is reduced to one or two *byte segments*: uint8 views
``[num_blocks, seg_bytes]`` over the cache's storage (K and V are two segments
in the split layout). A host slot row is the concatenation of a layer's
segments, so the stored bytes do not depend on the dtype view.

Why per-row numpy copies on CPU: on this torch CPU build ``Tensor.copy_``,
``index_select`` and ``index_copy_`` of uint8 rows move 0.2-0.6 GB/s, while a
numpy row assignment over the same memory is a memcpy (~10 GB/s; measured in
benchmarks/bench_transfer.py). On a GPU the opposite holds: gather on the
device, then one device-to-host copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from himamba.tiers.cpu_pool import HostSlotPool


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


def _pairs(block_ids: Sequence[int], slots: Sequence[int]) -> list[tuple[int, int]]:
    if len(block_ids) != len(slots):
        raise ValueError(f"{len(block_ids)} blocks for {len(slots)} slots")
    return list(zip(block_ids, slots, strict=True))


def _copy_segment(
    seg: torch.Tensor,
    np_seg: np.ndarray | None,
    host: torch.Tensor,
    np_host: np.ndarray,
    pairs: list[tuple[int, int]],
    to_host: bool,
) -> None:
    """Move rows between one cache segment and its column range of a pool row."""
    if np_seg is not None:  # host-resident cache: numpy row copies (memcpy)
        if to_host:
            for block, slot in pairs:
                np_host[slot] = np_seg[block]
        else:
            for block, slot in pairs:
                np_seg[block] = np_host[slot]
        return
    idx = torch.tensor([b for b, _ in pairs], dtype=torch.long, device=seg.device)
    rows = torch.tensor([s for _, s in pairs], dtype=torch.long)
    if to_host:
        host[rows] = seg.index_select(0, idx).to("cpu")
    else:
        seg.index_copy_(0, idx, host[rows].pin_memory().to(seg.device, non_blocking=True))


def _transfer(
    layers: Sequence[LayerBlocks],
    layer_block_ids: Sequence[Sequence[int]],
    pool: HostSlotPool,
    slots: Sequence[int],
    to_host: bool,
) -> int:
    moved = 0
    for li, (layer, ids) in enumerate(zip(layers, layer_block_ids, strict=True)):
        pairs = _pairs(ids, slots)
        offset = 0
        for si, seg in enumerate(layer.segments):
            cols = slice(offset, offset + seg.shape[1])
            np_seg = None if layer.np_segments is None else layer.np_segments[si]
            _copy_segment(
                seg, np_seg, pool.rows[li][:, cols], pool.np_rows[li][:, cols], pairs, to_host
            )
            offset += seg.shape[1]
        moved += layer.block_bytes * len(pairs)
    return moved


def device_to_host(
    layers: Sequence[LayerBlocks],
    layer_block_ids: Sequence[Sequence[int]],
    pool: HostSlotPool,
    slots: Sequence[int],
) -> int:
    """Copy block ``layer_block_ids[l][i]`` of layer l into slot ``slots[i]``; returns bytes."""
    return _transfer(layers, layer_block_ids, pool, slots, to_host=True)


def host_to_device(
    layers: Sequence[LayerBlocks],
    layer_block_ids: Sequence[Sequence[int]],
    pool: HostSlotPool,
    slots: Sequence[int],
) -> int:
    """Copy slot ``slots[i]`` into block ``layer_block_ids[l][i]`` of each layer l."""
    return _transfer(layers, layer_block_ids, pool, slots, to_host=False)
