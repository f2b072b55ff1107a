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
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator

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
        and not x.children
        and not x.n_host
        and not x.mamba & (HOST | PENDING)
        and not x.held
    )


class EvictionPolicy:
    """The three recency orders of the tree and the choice of victims from them."""

    def __init__(self, track_trim: bool) -> None:
        self.kv_lru: OrderedDict[Node, None] = OrderedDict()
        self.mamba_lru: OrderedDict[Node, None] = OrderedDict()
        self.track_trim = track_trim
        self._trim_heap: list[tuple[int, int, Node]] = []
        self._heap_after_compaction = 0
        self._clock = 0
        self._seq = 0

    # ------------------------------------------------------------------ recency
    def touch_path(self, node: Node, kv: bool = True) -> None:
        """A call used ``node`` and so its whole path: stamp it for trimming, and (``kv``)
        move its host-evictable nodes to the MRU end of the host-KV LRU, leaf first.

        Marks pass ``kv=False``: knowing a block is on GPU or in storage says nothing about
        whether its host copy was useful, so it must not reorder host eviction."""
        self._clock += 1
        stamp = clock = self._clock
        track, lru = self.track_trim, self.kv_lru
        to_end = lru.move_to_end
        x = node
        while x.parent is not None:
            if kv:
                if x.n_host and not x.kv_lock and not x.n_pend:  # kv_evictable, inlined
                    clock += 1
                    x.kv_access = clock
                    lru[x] = None
                    to_end(x)
                elif x in lru:
                    del lru[x]
            if track:
                x.seen = stamp
            x = x.parent
        self._clock = clock
        if track:
            self.offer(node)

    def withdraw_kv(self, x: Node) -> None:
        """``x`` stopped being host-evictable (locked, pending, or lost its host KV)."""
        self.kv_lru.pop(x, None)

    def sync_mamba(self, x: Node, touch: bool = False) -> None:
        """Re-apply the Mamba LRU rule to ``x``; ``touch`` makes a member the MRU."""
        if not mamba_evictable(x):
            self.mamba_lru.pop(x, None)
        elif touch or x not in self.mamba_lru:
            self._clock += 1
            x.mamba_access = self._clock
            self.mamba_lru[x] = None
            self.mamba_lru.move_to_end(x)

    def forget(self, x: Node) -> None:
        """``x`` left the tree (its trim entries go stale on their own)."""
        self.kv_lru.pop(x, None)
        self.mamba_lru.pop(x, None)

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
        return next(iter(self.kv_lru), None)

    def mamba_victim(self) -> Node | None:
        return next(iter(self.mamba_lru), None)

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
