"""What the tree hands out: a match (the hit and its prefetch plan) and a lock handle."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from himamba.tiers.object_format import ObjectKind

from .node import NO_SLOT, Node


class StoreCursor:
    """Where a request's last store ended: the node holding its newest stored block.

    A request stores its blocks in runs (one per prefill chunk or filled decode block), each
    beginning where the previous one ended, and its Mamba states at those ends. Handing the
    tree the previous run's node lets it start the next walk there instead of at the root.
    The tree checks the node before trusting it (still attached, ending at the right block
    with the right hash, same partition) and walks from the root otherwise, so a stale cursor
    costs one walk, never a wrong path. Opaque to callers."""

    __slots__ = ("node",)

    def __init__(self) -> None:
        self.node: Node | None = None


@dataclass
class MatchResult:
    """A hybrid hit: KV for blocks ``[start_block, num_blocks)`` plus the Mamba state at
    ``num_blocks``. ``kv_slots[j]`` is the host slot of block ``start_block + j``, or
    ``NO_SLOT`` when that block is only in storage (listed in ``storage_blocks``: the
    prefetch plan). ``host_num_blocks`` is the deepest hit that needs no prefetch at all.
    ``boundaries`` lists every boundary in ``(start_block, num_blocks]`` with a loadable
    state, ascending, as ``(boundary, state_on_host)``: a planner that cannot reserve the
    whole plan falls back to the deepest one whose storage-only blocks it holds."""

    num_blocks: int
    start_block: int
    partition: Hashable
    kv_slots: list[int] = field(default_factory=list)
    storage_blocks: list[int] = field(default_factory=list)
    mamba_slot: int = NO_SLOT
    mamba_in_storage: bool = False
    host_num_blocks: int = 0
    boundaries: list[tuple[int, bool]] = field(default_factory=list)
    _node: Node | None = field(default=None, repr=False, compare=False)
    _host_node: Node | None = field(default=None, repr=False, compare=False)

    def state_slot(self, host_only: bool = False) -> int:
        """Host Mamba slot of the state this hit loads: the ``host_num_blocks`` hit's when
        ``host_only``, else the full hit's (``NO_SLOT`` while that state is storage-only)."""
        node = self._host_node if host_only else self._node
        if node is None:
            raise ValueError("no hit: the result has no state to load")
        return node.mamba_slot


@dataclass(eq=False)
class LockHandle:
    """What one pending load (or one pin) locked, recorded at lock time and never
    re-derived (sgl-project/sglang#27147): ``kv_node`` and its whole path hold one ``kv_lock`` each,
    ``mamba_node`` (``kv_node`` itself, or None) one ``mamba_lock``."""

    kv_node: Node | None
    mamba_node: Node | None
    pinned: bool = False
    released: bool = False


@dataclass(frozen=True, slots=True)
class HotObject:
    """A host object selective write-through sends to storage: its kind, host slot and key
    hash (a state's is its boundary block's)."""

    kind: ObjectKind
    slot: int
    block_hash: bytes
