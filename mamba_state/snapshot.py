"""Snapshot and restore of Mamba boundary states between device pages and host slots.

A host Mamba slot holds the state of every Mamba layer of every Mamba group at
one boundary, because a hybrid hit is only valid when all of them are restored
together (a state for some groups only would still produce wrong tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.transfer import (
    CopyPlan,
    LayerBlocks,
    plan_copies,
)

NULL_BLOCK = 0


class MambaSnapshotter:
    """Copies boundary states; layers are ordered group by group, as in the slot layout."""

    def __init__(
        self, layers: Sequence[LayerBlocks], layers_per_group: Sequence[int], pool: HostSlotPool
    ) -> None:
        self.layers = list(layers)
        self.layers_per_group = list(layers_per_group)
        self.pool = pool

    def _per_layer(self, group_blocks: Sequence[Sequence[int]]) -> list[Sequence[int]]:
        if len(group_blocks) != len(self.layers_per_group):
            raise ValueError(
                f"got blocks for {len(group_blocks)} Mamba groups, model has "
                f"{len(self.layers_per_group)}"
            )
        out: list[Sequence[int]] = []
        for blocks, count in zip(group_blocks, self.layers_per_group, strict=True):
            if any(b == NULL_BLOCK for b in blocks):
                raise ValueError("a Mamba boundary state cannot live in the null block")
            out.extend([blocks] * count)
        return out

    def plan_snapshot(
        self, group_blocks: Sequence[Sequence[int]], slots: Sequence[int]
    ) -> CopyPlan:
        """Copy ``group_blocks[g][i]`` of every group into host slot ``slots[i]``, as a plan for
        the copy engine (ids checked now, bytes moved when it runs)."""
        return plan_copies(self.layers, self._per_layer(group_blocks), self.pool, slots, True)

    def plan_restore(self, group_blocks: Sequence[Sequence[int]], slots: Sequence[int]) -> CopyPlan:
        """Copy host slot ``slots[i]`` into block ``group_blocks[g][i]`` of every group, as a
        plan for the copy engine."""
        return plan_copies(self.layers, self._per_layer(group_blocks), self.pool, slots, False)
