"""Block copies between vLLM's per-layer caches and the host slot pool.

vLLM hands each layer's cache as a tensor whose block axis is dim 0 (CPU,
Mamba pages, most layouts) or dim 1 (GPU ``[2, num_blocks, ...]`` K/V split).
We gather/scatter along that axis with index ops, so any layout whose block is
a sub-tensor works, and the host copy of a block is always the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from himamba.tiers.cpu_pool import HostSlotPool


@dataclass(frozen=True)
class LayerBlocks:
    name: str
    tensor: torch.Tensor
    block_dim: int
    block_bytes: int

    @classmethod
    def wrap(cls, name: str, tensor: torch.Tensor, num_blocks: int) -> LayerBlocks:
        """Find the block axis and the bytes one block carries."""
        if tensor.dim() >= 1 and tensor.shape[0] == num_blocks:
            block_dim = 0
        elif tensor.dim() >= 2 and tensor.shape[1] == num_blocks and tensor.shape[0] == 2:
            block_dim = 1
        else:
            raise ValueError(
                f"layer {name}: cannot find the block axis of a cache of shape "
                f"{tuple(tensor.shape)} with {num_blocks} blocks"
            )
        nbytes = tensor.numel() // num_blocks * tensor.element_size()
        return cls(name, tensor, block_dim, nbytes)

    def gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks as ``[n, block_bytes]`` uint8 on the cache's device."""
        x = self.tensor.index_select(self.block_dim, block_ids)
        if self.block_dim == 1:
            x = x.transpose(0, 1)
        return x.contiguous().view(torch.uint8).reshape(len(block_ids), self.block_bytes)

    def scatter(self, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """Write ``[n, block_bytes]`` uint8 rows into the given blocks."""
        shape = list(self.tensor.shape)
        del shape[self.block_dim]
        if self.block_dim == 1:
            x = data.view(self.tensor.dtype).reshape(len(block_ids), *shape).transpose(0, 1)
        else:
            x = data.view(self.tensor.dtype).reshape(len(block_ids), *shape)
        self.tensor.index_copy_(self.block_dim, block_ids, x)


def _ids(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long, device=device)


def device_to_host(
    layers: Sequence[LayerBlocks],
    layer_block_ids: Sequence[Sequence[int]],
    pool: HostSlotPool,
    slots: Sequence[int],
) -> int:
    """Copy block ``layer_block_ids[l][i]`` of layer l into slot ``slots[i]``; returns bytes."""
    slot_idx = _ids(slots, torch.device("cpu"))
    moved = 0
    for layer, row, ids in zip(layers, pool.rows, layer_block_ids, strict=True):
        data = layer.gather(_ids(ids, layer.tensor.device))
        row.index_copy_(0, slot_idx, data.to("cpu"))
        moved += data.numel()
    return moved


def host_to_device(
    layers: Sequence[LayerBlocks],
    layer_block_ids: Sequence[Sequence[int]],
    pool: HostSlotPool,
    slots: Sequence[int],
) -> int:
    """Copy slot ``slots[i]`` into block ``layer_block_ids[l][i]`` of each layer l."""
    slot_idx = _ids(slots, torch.device("cpu"))
    moved = 0
    for layer, row, ids in zip(layers, pool.rows, layer_block_ids, strict=True):
        device = layer.tensor.device
        data = row.index_select(0, slot_idx)
        if device.type != "cpu":
            data = data.pin_memory().to(device, non_blocking=True)
        layer.scatter(_ids(ids, device), data)
        moved += data.numel()
    return moved
