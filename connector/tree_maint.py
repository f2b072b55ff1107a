"""Maintenance machinery of ``HybridRadixTree``: how the tree keeps itself consistent.

Split out of ``radix_tree.py`` along the line between *what* the tree offers and *how* it
stays correct. ``radix_tree`` holds the public operations (match, lock/unlock, reserve and
complete stores, eviction entry points, GPU/storage mirroring); each is a short sequence of
calls into the internals here: path insertion and node splitting, the cascade that enforces
invariant P (``_kill_from``, ``_prune``, ``_settle`` and the ``_dirty`` queue that ``_flush``
drains), tier marking and clearing, slot allocation and the LRU bookkeeping. Nothing here is
public API; ``_TreeMaintenance`` is a mixin that only ``HybridRadixTree`` inherits, so every
internal stays reachable under its old name (``tree._locate``, ``tree._dirty``, ...) for
``tree_invariants`` and the tests. The state it works on is created by
``HybridRadixTree.__init__``; the annotations below only name it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from .host_slots import SlotPool
from .tree_node import GPU, HOST, NO_SLOT, PENDING, Node


def _common(a: list[bytes], b: Sequence[bytes], pos: int, k: int) -> int:
    """How many of ``a[:k]`` equal ``b[pos:pos+k]``, given ``a[0] == b[pos]`` (chained hashes)."""
    if a[k - 1] == b[pos + k - 1]:
        return k
    lo, hi = 1, k - 1  # a[lo-1] matches, a[hi] does not
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] == b[pos + mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo


class _TreeMaintenance:
    """Internal operations of ``HybridRadixTree`` (see the module docstring)."""

    kv_pool: SlotPool
    mamba_pool: SlotPool
    roots: dict[Hashable, Node]
    kv_lru: OrderedDict[Node, None]
    mamba_lru: OrderedDict[Node, None]
    pending_kv: dict[int, tuple[Node, int]]
    pending_mamba: dict[int, Node]
    doomed: set[Node]
    _dirty: list[Node]
    num_nodes: int
    _clock: int
    counters: dict[str, int]

    def _alloc(self, pool: SlotPool, evict: Callable[[int], int]) -> int | None:
        slot = pool.alloc()
        if slot is None:
            evict(1)
            slot = pool.alloc()
        if slot is None:
            self.counters["alloc_failures"] += 1
        return slot

    def _locate(
        self, hashes: Sequence[bytes], partition: Hashable, end: int
    ) -> tuple[Node, int] | None:
        """The node holding block ``end - 1`` and its index there, without changing the tree."""
        node, pos = self.roots.get(partition), 0
        while node is not None and pos < end:
            child = node.children.get(hashes[pos])
            if child is None:
                return None
            k = min(len(child.hashes), end - pos)
            if _common(child.hashes, hashes, pos, k) < k:
                return None
            pos += k
            if pos == end:
                return child, k - 1
            node = child
        return None

    def _insert_path(
        self, hashes: Sequence[bytes], partition: Hashable, end: int, boundary: bool
    ) -> Node:
        """Create the path of blocks ``[0, end)``; return the node holding block ``end - 1``
        (ending exactly at ``end`` when ``boundary``). New blocks have no tier yet."""
        node = self.roots.get(partition)
        if node is None:
            node = self.roots[partition] = Node(None, partition, 0, [])
        pos = 0
        while True:
            child = node.children.get(hashes[pos])
            if child is None:
                if node.parent is not None and not node.children and not node.mamba:
                    node.extend(list(hashes[pos:end]))  # grow a stateless leaf in place
                    node.tombstone = False
                    return node
                child = Node(node, partition, pos, list(hashes[pos:end]))
                node.children[hashes[pos]] = child
                self.num_nodes += 1
                return child
            size = len(child.hashes)
            k = min(size, end - pos)
            m = _common(child.hashes, hashes, pos, k)
            if m < size and (m < k or boundary):
                child = self._split(child, m)
            pos += m
            if pos == end:
                return child
            node = child

    def _split(self, node: Node, k: int) -> Node:
        head = node.split(k)
        self.num_nodes += 1
        if node in self.doomed:  # both halves hold pre-reset content
            self.doomed.add(head)
        self._dirty += (head, node)
        for part in (head, node):
            if part.n_pend:
                for i, f in enumerate(part.flags):
                    if f & PENDING:
                        self.pending_kv[part.slots[i]] = (part, i)  # type: ignore[index]
        if not node.children and not node.n_live and not node.mamba and not node.held:
            del head.children[node.hashes[0]]  # the tail was only trailing tier-less blocks
            node.parent = None
            self.num_nodes -= 1
            self.kv_lru.pop(node, None)
            self.doomed.discard(node)
            self._touch_kv_path(head)
        else:
            self._touch_kv_path(node)  # both halves re-enter the LRU in leaf-first order
        return head

    def _fill_absent(self, node: Node, upto: int, bit: int) -> None:
        """Give ``bit`` to every tier-less block of the path before ``node[upto]``."""
        x: Node | None = node
        while x is not None and x.parent is not None:
            if x.n_live < len(x.hashes):
                i = x.flags.find(0, 0, upto)
                while 0 <= i:
                    x.set_flag(i, bit)
                    i = x.flags.find(0, i + 1, upto)
            x = x.parent
            upto = len(x.hashes) if x is not None else 0

    def _mark(
        self, hashes: Sequence[bytes], partition: Hashable, num_blocks: int, bit: int, mamba: bool
    ) -> None:
        if not 1 <= num_blocks <= len(hashes):
            raise IndexError(num_blocks)
        node = self._insert_path(hashes, partition, num_blocks, boundary=mamba)
        x, upto = node, num_blocks - node.start
        while x.parent is not None:
            if bit != GPU or x.n_gpu < len(x.hashes):
                for i in range(upto):
                    x.set_flag(i, x.flags[i] | bit)
            x = x.parent
            upto = len(x.hashes)
        if mamba:
            node.mamba |= bit
            node.tombstone = False
        self._flush()

    def _clear(
        self,
        hashes: Sequence[bytes],
        partition: Hashable,
        start: int,
        end: int | None,
        bit: int,
    ) -> None:
        end = len(hashes) if end is None else min(end, len(hashes))
        node, pos = self.roots.get(partition), 0
        hole: tuple[Node, int] | None = None
        while node is not None and pos < end:
            child = node.children.get(hashes[pos])
            if child is None:
                break
            k = _common(child.hashes, hashes, pos, min(len(child.hashes), end - pos))
            for i in range(max(start - pos, 0), k):
                child.set_flag(i, child.flags[i] & ~bit)
                if hole is None and not child.flags[i]:
                    hole = (child, i)
            if start < child.end <= end:
                child.mamba &= ~bit
            if k < len(child.hashes):
                break
            pos += k
            node = child
        if hole is not None:
            self._kill_from(hole[0], hole[1] + 1)
        elif node is not None and node.parent is not None:
            self._prune(node)

    def _kill_from(self, node: Node, first: int) -> int:
        """Drop every tier of blocks ``node[first:]``, the state at its end and the whole
        subtree, except what is held. Returns the number of host KV slots freed."""
        freed = 0
        stack, seen = [(node, first)], []
        while stack:
            x, i = stack.pop()
            seen.append(x)
            if not x.held:
                if not i and self.doomed:
                    self.doomed.discard(x)  # all of it goes now: the reset is carried out
                for j in range(i, len(x.hashes)):
                    f = x.flags[j]
                    if f & HOST:
                        self.kv_pool.free(x.slots[j])  # type: ignore[index]
                        x.slots[j] = NO_SLOT  # type: ignore[index]
                        freed += 1
                    if f:
                        x.set_flag(j, 0)
                if x.mamba:
                    if x.mamba & HOST:
                        self.mamba_pool.free(x.mamba_slot)
                        x.mamba_slot = NO_SLOT
                        self.counters["mamba_cascaded"] += 1
                    x.mamba = 0
                    self.mamba_lru.pop(x, None)
                if not x.kv_evictable:
                    self.kv_lru.pop(x, None)
            stack.extend((c, 0) for c in x.children.values())
        self.counters["kv_cascaded"] += freed
        for x in reversed(seen):
            self._prune(x)
        return freed

    def _prune(self, x: Node) -> None:
        """Detach ``x`` and its ancestors while they are empty, unheld leaves."""
        while (
            x.parent is not None and not x.children and not x.n_live and not x.mamba and not x.held
        ):
            parent = x.parent
            del parent.children[x.hashes[0]]
            x.parent = None
            self.num_nodes -= 1
            self.kv_lru.pop(x, None)
            self.mamba_lru.pop(x, None)
            self.doomed.discard(x)
            if parent.parent is None and not parent.children:
                del self.roots[parent.partition]
            x = parent

    def _settle(self, node: Node) -> None:
        """``node`` may have stopped being held: enforce invariant P on its path (drop it if
        a block above it lost every tier meanwhile), prune, and put it back in the LRUs."""
        path: list[Node] = []
        x = node
        while x.parent is not None:
            path.append(x)
            x = x.parent
        for x in reversed(path):
            if self.doomed and x in self.doomed and not x.held:
                self.doomed.discard(x)
                self._kill_from(x, 0)
                break
            if x.n_live < len(x.hashes):
                self._kill_from(x, x.flags.find(0) + 1)
                break
        if node.parent is not None:
            self._prune(node)
        for x in path:
            if x.parent is not None:
                self._sync_mamba(x, touch=x is node)
                self._touch_kv_path(x)
                break

    def _flush(self) -> None:
        while self._dirty:
            x = self._dirty.pop()
            if x.parent is not None:
                self._settle(x)

    def _touch_kv_path(self, node: Node) -> None:
        x = node
        while x.parent is not None:
            if x.kv_evictable:
                self._clock += 1
                x.kv_access = self._clock
                self.kv_lru[x] = None
                self.kv_lru.move_to_end(x)
            else:
                self.kv_lru.pop(x, None)
            x = x.parent

    def _sync_mamba(self, x: Node, touch: bool) -> None:
        if not x.mamba_evictable:
            self.mamba_lru.pop(x, None)
        elif touch or x not in self.mamba_lru:
            self._clock += 1
            x.mamba_access = self._clock
            self.mamba_lru[x] = None
            self.mamba_lru.move_to_end(x)
