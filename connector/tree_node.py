"""One node of the hybrid radix tree: a run of blocks plus the Mamba state at its end.

Tier presence is kept *per block* inside a node (a ``bytearray`` of bit flags) instead of
splitting a node whenever two blocks live in different tiers. Stores arrive one block at a
time and vLLM evicts GPU blocks in any order, so node-uniform tiers would shred every
conversation into one-block nodes; per-block flags keep nodes as long as the branching and
the Mamba boundaries allow, and make a match cost O(nodes), not O(blocks).

No vLLM import here: the tree is a pure data structure, testable on any machine.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable

# Tier bits, used both for a block's KV (``Node.flags[i]``) and for the Mamba state at the
# node end (``Node.mamba``).
GPU = 1  # mirrored from the scheduler: vLLM's paged cache holds it (may be stale or coarse)
HOST = 2  # committed in a pinned-CPU slot owned by the tree
PENDING = 4  # a host slot is reserved and a store is in flight: locked, not matchable
STORAGE = 8  # present in the storage tier (LMCache); the tree holds no bytes for it
LOADABLE = HOST | STORAGE  # what a hit may read beyond vLLM's own GPU prefix
NO_SLOT = -1


class Node:
    """A run of consecutive blocks on one path of the tree.

    ``start`` is the index of the node's first block in every request that reaches it, so
    the node's end boundary is ``start + len(hashes)``. ``slots[i]`` is the host KV slot of
    block ``start + i`` (``NO_SLOT`` unless ``HOST`` or ``PENDING``); it is allocated lazily
    because GPU-only and storage-only nodes never need it. Counters mirror the flags so that
    the common checks ("is every block of this node loadable?") are O(1).

    Locks follow the reference's split, kept apart: ``kv_lock`` counts in-flight loads that
    read this node's host KV (taken on the whole path to the root, so a locked node's
    ancestors are locked too), ``mamba_lock`` counts loads reading the host Mamba state at
    this node's end (node only). In-flight stores are ``PENDING`` bits (``n_pend`` for KV,
    ``mamba & PENDING`` for the state).
    """

    __slots__ = (
        "parent",
        "children",
        "partition",
        "start",
        "hashes",
        "flags",
        "slots",
        "n_live",
        "n_load",
        "n_host",
        "n_pend",
        "n_gpu",
        "mamba",
        "mamba_slot",
        "tombstone",
        "kv_lock",
        "mamba_lock",
        "hits",
        "kv_access",
        "mamba_access",
    )

    def __init__(
        self, parent: Node | None, partition: Hashable, start: int, hashes: list[bytes]
    ) -> None:
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.partition = partition
        self.start = start
        self.hashes = hashes
        self.flags = bytearray(len(hashes))
        self.slots: array | None = None
        self.n_live = self.n_load = self.n_host = self.n_pend = self.n_gpu = 0
        self.mamba = 0
        self.mamba_slot = NO_SLOT
        self.tombstone = False
        self.kv_lock = 0
        self.mamba_lock = 0
        self.hits = 0
        self.kv_access = 0
        self.mamba_access = 0

    def __len__(self) -> int:
        return len(self.hashes)

    def __repr__(self) -> str:
        return f"Node(start={self.start}, len={len(self.hashes)}, flags={bytes(self.flags)!r}, mamba={self.mamba})"

    @property
    def end(self) -> int:
        return self.start + len(self.hashes)

    @property
    def held(self) -> bool:
        """Something in flight reads or writes this node: cascades must not touch it."""
        return bool(self.kv_lock or self.mamba_lock or self.n_pend or self.mamba & PENDING)

    @property
    def kv_evictable(self) -> bool:
        """Membership rule of the host-KV LRU."""
        return self.n_host > 0 and self.kv_lock == 0 and self.n_pend == 0

    @property
    def mamba_evictable(self) -> bool:
        """Membership rule of the host-Mamba LRU."""
        return bool(self.mamba & HOST) and self.mamba_lock == 0

    def set_flag(self, i: int, new: int) -> None:
        """The only writer of ``flags``: keeps the counters exact."""
        old = self.flags[i]
        if old == new:
            return
        self.flags[i] = new
        self.n_live += (new != 0) - (old != 0)
        self.n_load += bool(new & LOADABLE) - bool(old & LOADABLE)
        self.n_host += bool(new & HOST) - bool(old & HOST)
        self.n_pend += bool(new & PENDING) - bool(old & PENDING)
        self.n_gpu += bool(new & GPU) - bool(old & GPU)

    def set_slot(self, i: int, slot: int) -> None:
        if self.slots is None:
            if slot == NO_SLOT:
                return
            self.slots = array("q", [NO_SLOT]) * len(self.hashes)
        self.slots[i] = slot

    def slot(self, i: int) -> int:
        return NO_SLOT if self.slots is None else self.slots[i]

    def recount(self) -> None:
        """Recompute the counters from the flags (after a split)."""
        f = self.flags
        n = len(f)
        self.n_live = n - f.count(0)
        self.n_load = sum(1 for x in f if x & LOADABLE)
        self.n_host = sum(1 for x in f if x & HOST)
        self.n_pend = sum(1 for x in f if x & PENDING)
        self.n_gpu = sum(1 for x in f if x & GPU)

    def extend(self, hashes: list[bytes]) -> None:
        """Append absent blocks to a stateless leaf (write-through grows one block at a time)."""
        self.hashes.extend(hashes)
        self.flags.extend(bytes(len(hashes)))
        if self.slots is not None:
            self.slots.extend([NO_SLOT] * len(hashes))

    def split(self, k: int) -> Node:
        """Cut after ``k`` blocks; return the new *head*. ``self`` keeps the tail.

        The tail keeps its identity, children, Mamba state, hit count and LRU entries, so
        handles and LRU lists that point at it stay valid. The head inherits ``kv_lock``:
        every load locking the tail locked its whole path, and the head is on that path.
        """
        assert 0 < k < len(self.hashes), "split must leave both halves non-empty"
        head = Node(self.parent, self.partition, self.start, self.hashes[:k])
        head.flags = self.flags[:k]
        if self.slots is not None:
            head.slots = self.slots[:k]
            self.slots = self.slots[k:]
        self.hashes = self.hashes[k:]
        self.flags = self.flags[k:]
        self.start += k
        head.recount()
        self.recount()
        head.kv_lock = self.kv_lock
        head.hits = self.hits
        head.kv_access = self.kv_access
        assert self.parent is not None
        self.parent.children[head.hashes[0]] = head
        head.children[self.hashes[0]] = self
        self.parent = head
        return head
