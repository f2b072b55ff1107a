"""Eviction policy of the hybrid radix tree: what goes next under host or metadata pressure.

The policy *decides*; the tree frees (so slot conservation stays in one place). It keeps
three orders, each with a membership rule below that ``invariants.check_invariants`` recomputes
from scratch after every step:

* **Host-KV LRU** over nodes whose host KV may be evicted (``kv_evictable``). A touch moves
  the node *and then its ancestors* to the MRU end, so descendants always precede ancestors
  and the head is a host leaf: evicting from its end never strands host KV below it. The tree
  evicts the head one block at a time from its end (a whole node is a whole conversation, far
  more than one reservation needs); a partially evicted node keeps its place at the head.
* **Host-Mamba LRU** over evictable host states; touched only for the state a hit consumes or
  a store commits (refreshing the whole matched path evicts whole sessions under Mamba
  pressure, sgl-project/sglang#31643).
* **Trim order** over *metadata leaves* (``trimmable``): unheld leaves whose blocks and state
  carry only GPU / STORAGE marks, so dropping them frees no bytes and loses only knowledge.
  Ordered by ``seen``, the last time a lookup, store or mark used the node's path. It is a
  lazy min-heap: an entry is live while its stamp equals the node's ``seen`` and the node is
  still trimmable; stale entries are skipped when popped and compacted away in bulk. Kept
  only when the tree has a node budget, so an unbounded tree pays nothing for it.

Both host LRUs are *lazy*: a member carries its access stamp (``kv_access`` /
``mamba_access``, > 0) and has one entry in a min-heap, queued at the stamp it had then; a
node that left the order keeps its entry (stamp ``QUEUED``) until eviction reaches it, and 0
means no entry. A touch only re-stamps the node, so a hit costs a few attribute writes
instead of moving every node of its path in a linked list; eviction re-queues an entry whose
node was touched since, and drops one whose node left the order, until the top entry is
current. The victim is the member with the smallest stamp: exactly the head the eager list
would have had, so the order of evictions is the same.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from heapq import heapify, heappop, heappush, heapreplace

from .node import HOST, PENDING, Node


def kv_evictable(x: Node) -> bool:
    """Membership rule of the host-KV LRU."""
    return x.n_host > 0 and x.kv_lock == 0 and x.n_pend == 0


def mamba_evictable(x: Node) -> bool:
    """Membership rule of the host-Mamba LRU."""
    return bool(x.mamba & HOST) and x.mamba_lock == 0


def trimmable(x: Node) -> bool:
    """A metadata leaf: attached, childless, unheld, no host KV, no host or pending state."""
    return (
        x.parent is not None
        and x.kids is None
        and not x.n_host
        and not x.mamba & (HOST | PENDING)
        and not x.held
    )


# ``kv_access`` / ``mamba_access`` of a node that is no LRU member but still has its heap
# entry (an entry is only dropped when eviction reaches it). 0: no member and no entry.
QUEUED = -1

# A heap entry is one int, ``stamp << _ID_BITS | id``, ``id`` indexing ``_by_id``: ints
# compare in C without touching a node or a tuple, which makes a pop from a heap of 250,000
# entries ~3.5x cheaper than with ``(stamp, node)`` tuples, and an entry 40 bytes, not 72.
_ID_BITS = 32
_ID_MASK = (1 << _ID_BITS) - 1


class EvictionPolicy:
    """The three recency orders of the tree and the choice of victims from them."""

    def __init__(self, track_trim: bool) -> None:
        # Lazy LRU heaps: one entry per node whose access stamp is not 0, queued at a stamp
        # no later than the node's (a member's stamp is > 0).
        self._kv_heap: list[int] = []
        self._mamba_heap: list[int] = []
        self._by_id: list[Node | None] = []  # ``Node.lru_id`` -> node, while it has entries
        self._free_ids: list[int] = []
        self._gone = 0  # heap entries of nodes that left the tree (compaction trigger)
        self.track_trim = track_trim
        self._trim_heap: list[tuple[int, int, Node]] = []
        self._heap_after_compaction = 0
        self._clock = 0
        self._seq = 0

    # ------------------------------------------------------------------ recency
    def touch_path(self, node: Node, kv: bool = True) -> None:
        """A call used ``node`` and so its whole path: stamp it for trimming, and (``kv``)
        make its host-evictable nodes the most recently used, leaf first (so each ancestor
        is more recent than its descendants), and drop the others from the host-KV LRU.

        A touch only stamps: the heap entry of a node already in it stays where it is and
        is moved when eviction reaches it (lazy promotion), so a hit costs no heap work.
        Marks pass ``kv=False``: knowing a block is on GPU or in storage says nothing about
        whether its host copy was useful, so it must not reorder host eviction."""
        self._clock += 1
        stamp = clock = self._clock
        if kv:
            x = node
            while x.parent is not None:
                if x.n_host and not x.kv_lock and not x.n_pend:  # kv_evictable, inlined
                    clock += 1
                    if not x.kv_access:
                        heappush(self._kv_heap, clock << _ID_BITS | self._id(x))
                    x.kv_access = clock
                elif x.kv_access > 0:
                    x.kv_access = QUEUED
                x = x.parent
            self._clock = clock
        if self.track_trim:
            x = node
            while x.parent is not None:
                x.seen = stamp
                x = x.parent
            self.offer(node)

    def withdraw_kv(self, x: Node) -> None:
        """``x`` stopped being host-evictable (locked, pending, or lost its host KV)."""
        if x.kv_access > 0:
            x.kv_access = QUEUED

    def sync_mamba(self, x: Node, touch: bool = False) -> None:
        """Re-apply the Mamba LRU rule to ``x``; ``touch`` makes a member the MRU."""
        a = x.mamba_access
        if not (x.mamba & HOST and not x.mamba_lock):  # mamba_evictable, inlined
            if a > 0:
                x.mamba_access = QUEUED
        elif touch or a <= 0:
            self._clock += 1
            if not a:
                heappush(self._mamba_heap, self._clock << _ID_BITS | self._id(x))
            x.mamba_access = self._clock

    def forget(self, x: Node) -> None:
        """``x`` left the tree (its heap entries go stale on their own)."""
        if x.kv_access or x.mamba_access:
            x.kv_access = QUEUED if x.kv_access else 0
            x.mamba_access = QUEUED if x.mamba_access else 0
            self._gone += 1
            if self._gone > 1024 and 2 * self._gone > len(self._kv_heap) + len(self._mamba_heap):
                self._compact_lru()

    def kv_members(self) -> list[Node]:
        """Every node in the host-KV LRU, least recent first (for the checker)."""
        nodes = (x for w, _, x in self.lru_entries() if w == "kv" and x.kv_access > 0)
        return sorted(nodes, key=_kv_stamp)

    def mamba_members(self) -> list[Node]:
        """Every node in the host-Mamba LRU, least recent first (for the checker)."""
        nodes = (x for w, _, x in self.lru_entries() if w == "mamba" and x.mamba_access > 0)
        return sorted(nodes, key=_mamba_stamp)

    def lru_entries(self) -> Iterator[tuple[str, int, Node]]:
        """``(which, stamp, node)`` of every heap entry, live or stale (for the checker)."""
        for which, heap in (("kv", self._kv_heap), ("mamba", self._mamba_heap)):
            for e in heap:
                x = self._by_id[e & _ID_MASK]
                assert x is not None and x.lru_id == e & _ID_MASK, "heap entry of a freed id"
                yield which, e >> _ID_BITS, x

    def ids_in_use(self) -> int:
        """How many nodes hold an id (for the checker: each has an entry in some heap)."""
        return len(self._by_id) - len(self._free_ids)

    def _id(self, x: Node) -> int:
        i = x.lru_id
        if i < 0:
            if self._free_ids:
                i = self._free_ids.pop()
                self._by_id[i] = x
            else:
                i = len(self._by_id)
                self._by_id.append(x)
            x.lru_id = i
        return i

    def _release(self, x: Node) -> None:
        """One of ``x``'s entries left its heap: free its id once it has none."""
        if not x.kv_access and not x.mamba_access:
            self._by_id[x.lru_id] = None
            self._free_ids.append(x.lru_id)
            x.lru_id = -1

    def _compact_lru(self) -> None:
        """Drop the entries of nodes that are no LRU member (left the tree, or evictable no
        more): each node keeps at most one entry per heap, so the heaps stay O(members)."""
        dropped: list[Node] = []
        kv = self._members_of(self._kv_heap, "kv_access", dropped)
        mamba = self._members_of(self._mamba_heap, "mamba_access", dropped)
        self._kv_heap, self._mamba_heap, self._gone = kv, mamba, 0
        for x in dropped:
            if x.lru_id >= 0:  # type: ignore[union-attr]
                self._release(x)  # type: ignore[arg-type]

    def _members_of(self, heap: list[int], access: str, dropped: list[Node]) -> list[int]:
        """The entries of ``heap`` whose node is still a member (by its ``access`` stamp), as
        a new heap; the others' stamps are cleared and their nodes added to ``dropped``."""
        by_id, kept = self._by_id, []
        for e in heap:
            x = by_id[e & _ID_MASK]
            if getattr(x, access) > 0 and x.parent is not None:  # type: ignore[union-attr]
                kept.append(e)
            else:
                setattr(x, access, 0)
                dropped.append(x)  # type: ignore[arg-type]
        heapify(kept)
        return kept

    def offer(self, x: Node) -> None:
        """``x`` may have become a metadata leaf: queue it for trimming at its ``seen``."""
        if not self.track_trim or not trimmable(x):
            return
        self._seq += 1
        heapq.heappush(self._trim_heap, (x.seen, self._seq, x))
        if len(self._trim_heap) > 2 * self._heap_after_compaction + 1024:
            self._compact()

    # ------------------------------------------------------------------ victims
    def kv_victim(self) -> Node | None:
        """The host leaf to evict from (its last host block goes first), or None."""
        heap, by_id = self._kv_heap, self._by_id
        while heap:
            e = heap[0]
            x = by_id[e & _ID_MASK]
            a = x.kv_access  # type: ignore[union-attr]
            if a == e >> _ID_BITS:
                return x
            if a > 0:  # touched since it was queued: re-queue at its stamp
                heapreplace(heap, a << _ID_BITS | (e & _ID_MASK))
            else:  # no member now: its one entry goes
                heappop(heap)
                x.kv_access = 0  # type: ignore[union-attr]
                self._release(x)  # type: ignore[arg-type]
        return None

    def mamba_victim(self) -> Node | None:
        heap, by_id = self._mamba_heap, self._by_id
        while heap:
            e = heap[0]
            x = by_id[e & _ID_MASK]
            a = x.mamba_access  # type: ignore[union-attr]
            if a == e >> _ID_BITS:
                return x
            if a > 0:
                heapreplace(heap, a << _ID_BITS | (e & _ID_MASK))
            else:
                heappop(heap)
                x.mamba_access = 0  # type: ignore[union-attr]
                self._release(x)  # type: ignore[arg-type]
        return None

    def trim_victim(self) -> Node | None:
        """The least recently seen metadata leaf (removed from the order), or None."""
        heap = self._trim_heap
        while heap:
            stamp, _, x = heapq.heappop(heap)
            if stamp == x.seen and trimmable(x):
                return x
        return None

    def trim_entries(self) -> Iterator[tuple[int, Node]]:
        """(stamp, node) of every queued trim entry, live or stale (for the checker)."""
        return ((s, x) for s, _, x in self._trim_heap)

    def _compact(self) -> None:
        live: dict[int, tuple[int, int, Node]] = {}
        for entry in self._trim_heap:
            stamp, _, x = entry
            if stamp == x.seen and trimmable(x):
                live[id(x)] = entry
        self._trim_heap = list(live.values())
        heapq.heapify(self._trim_heap)
        self._heap_after_compaction = len(self._trim_heap)


def _kv_stamp(x: Node) -> int:
    return x.kv_access


def _mamba_stamp(x: Node) -> int:
    return x.mamba_access
