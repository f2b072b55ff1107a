"""The plain records that travel from the scheduler half to the worker half each step.

They hold only ints (slots and block ids), so they pickle cheaply across vLLM's
process boundary and the worker never needs the index or the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from himamba.connector.fetch_protocol import FetchOrder


@dataclass
class LoadJob:
    """Restore one request's prefix: KV blocks plus the Mamba state at its end."""

    req_id: str
    kv_slots: list[int]
    # Per attention group (layout order): device block ids, parallel to kv_slots.
    kv_blocks: list[list[int]]
    mamba_slot: int
    # Per Mamba group (layout order): the device block that must hold the state.
    mamba_blocks: list[int]
    # Set when the scheduler already knows the load cannot be honoured; the
    # worker then reports it failed so vLLM recomputes instead of trusting it.
    doomed: str | None = None


@dataclass
class StoreBatch:
    """Device blocks to copy into host slots this step (after the forward)."""

    slots: list[int] = field(default_factory=list)
    # Per group (layout order) one device block id per slot.
    blocks: list[list[int]] = field(default_factory=list)
    # The block hash naming each slot's content (its storage key).
    hashes: list[bytes] = field(default_factory=list)

    def add(self, slot: int, group_blocks: list[int], block_hash: bytes) -> None:
        if not self.blocks:
            self.blocks = [[] for _ in group_blocks]
        self.slots.append(slot)
        self.hashes.append(block_hash)
        for column, block in zip(self.blocks, group_blocks, strict=True):
            column.append(block)

    def __len__(self) -> int:
        return len(self.slots)


@dataclass
class StepPlan:
    """Everything the worker does for the connector in one engine step."""

    loads: list[LoadJob] = field(default_factory=list)
    kv_stores: StoreBatch = field(default_factory=StoreBatch)
    mamba_stores: StoreBatch = field(default_factory=StoreBatch)
    # Storage -> host fetches to start, and fetch ids to drop before anything else is done.
    fetches: list[FetchOrder] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)
    # Host objects to copy to storage before anything else touches their slots this step
    # (selective write-through, write-back): (kind, host slot, block hash).
    storage_writes: list[tuple[int, int, bytes]] = field(default_factory=list)
    # Storage key epoch for this step's writes (changes when the cache is reset).
    epoch: str = ""

    def moves_bytes(self) -> bool:
        """Whether the worker copies host-tier bytes this step."""
        return bool(self.loads or self.kv_stores or self.mamba_stores or self.storage_writes)

    def is_empty(self) -> bool:
        return not (self.moves_bytes() or self.fetches or self.cancels)
