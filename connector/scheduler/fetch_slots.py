"""Host slots for a storage fetch: the deepest part of a storage hit the CPU tier can take now.

Tree work with its own rules, apart from the planner's request life cycle: the hit's path is
pinned so a reservation cannot evict the prefix being fetched, KV slots are reserved block by
block until the host is full, and the fetch ends at the deepest boundary with a state (on host,
or reserved too) that those slots reach. What is not kept is rolled back before returning.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from himamba.connector.protocol import FetchItem, ObjectKind
from himamba.connector.tree import HybridRadixTree, LockHandle, MatchResult


class Refused(enum.Enum):
    """Why no fetch was reserved; the value names the planner's counter."""

    BELOW_THRESHOLD = "storage_fetch_below_threshold"  # shortened below min_gain_blocks
    NO_SPACE = "storage_fetch_no_space"


@dataclass
class FetchSlots:
    pin: LockHandle  # over the fetched path, blocks [0, the fetch's boundary)
    items: list[FetchItem]  # the KV objects, then the state if it is not on host yet
    indexes: list[int]  # per item: its block (a state: the last block before its boundary)
    num_kv: int
    shortened: bool  # the room there was cut the hit back to a shallower boundary


def reserve_fetch(
    tree: HybridRadixTree,
    hashes: Sequence[bytes],
    partition: Hashable,
    hit: MatchResult,
    have: int,
    min_gain_blocks: int,
) -> FetchSlots | Refused:
    """Reserve host slots for the storage-only part of ``hit`` past ``have`` blocks."""
    pin = tree.pin(hashes, partition, hit.num_blocks)
    reserved: list[tuple[int, int]] = []  # (block index, slot), ascending
    for i in hit.storage_blocks:
        slot = tree.reserve_kv(hashes, partition, i, from_device=False)
        if slot is None:
            break
        reserved.append((i, slot))
    # Blocks below `reach` are on host or reserved: any boundary up to it is fetchable.
    reach = hit.num_blocks
    if len(reserved) < len(hit.storage_blocks):
        reach = hit.storage_blocks[len(reserved)]
    target, mamba_slot = 0, None
    for end, on_host in reversed(hit.boundaries):
        if end > reach or end <= hit.host_num_blocks:
            continue
        if on_host:
            target = end
            break
        mamba_slot = tree.reserve_mamba(hashes, partition, end, from_device=False)
        if mamba_slot is not None:
            target = end
            break
    below = bool(target) and target - have < min_gain_blocks
    if below:  # shortened (no room) below the threshold: not worth the round trip
        if mamba_slot is not None:
            tree.complete_store([], [mamba_slot], ok=False)
        target, mamba_slot = 0, None
    keep = [(i, s) for i, s in reserved if i < target]
    tree.complete_store([s for i, s in reserved if i >= target], [], ok=False)
    if not target:
        tree.unlock(pin)
        return Refused.BELOW_THRESHOLD if below else Refused.NO_SPACE
    shortened = target != hit.num_blocks
    if shortened:
        narrower = tree.pin(hashes, partition, target)
        tree.unlock(pin)
        pin = narrower
    items = [FetchItem(ObjectKind.KV, hashes[i], s) for i, s in keep]
    indexes = [i for i, _ in keep]
    if mamba_slot is not None:
        items.append(FetchItem(ObjectKind.MAMBA, hashes[target - 1], mamba_slot))
        indexes.append(target - 1)
    return FetchSlots(pin, items, indexes, len(keep), shortened)
