"""Hybrid radix tree: which prefix of a request can be served, from which tier, and what to evict.

Keys are vLLM block hashes. vLLM chains them (hash ``i`` covers blocks ``0..i`` plus the
cache salt / LoRA extra keys), so two runs of blocks that agree on their last hash agree on
every hash: the tree compares one hash per node and binary-searches only on divergence.
Requests are also partitioned (one root per ``partition``), so a different salt never
matches even if a caller passes unchained hashes for the first block.

Invariant P (liveness is prefix-closed), the rule that makes dead memory impossible: for
every node that nothing holds (no lock, no pending store), every block with a tier and the
Mamba state at its end have *every* earlier block of their path in some tier (GPU, host,
pending store or storage). When a block loses its last tier, everything after it that is not
held is dropped at once (``_kill_from``); held nodes are revalidated when released
(``_settle``). A store from the GPU marks its prefix as GPU-resident (the request really has
those blocks in its block table), which is how "block i stored while blocks < i are on GPU
only" keeps P. ``tree_invariants.check_invariants`` checks P and the rest after any call.

The public operations live here; the maintenance machinery they call (path insertion and
splits, the invariant-P cascade, tier marking, slot allocation, LRU bookkeeping) lives in
``tree_maint``, which ``HybridRadixTree`` inherits as the ``_TreeMaintenance`` mixin. The
split keeps this module the readable contract (what a caller may do and what it costs) and
keeps every internal name on the tree object, so nothing that reaches into it changed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from .host_slots import SlotPool
from .tree_maint import _common, _TreeMaintenance
from .tree_node import GPU, HOST, LOADABLE, NO_SLOT, PENDING, STORAGE, Node


@dataclass
class MatchResult:
    """A hybrid hit: KV for blocks ``[start_block, num_blocks)`` plus the Mamba state at
    ``num_blocks``. ``kv_slots[j]`` is the host slot of block ``start_block + j``, or
    ``NO_SLOT`` when that block is only in storage (listed in ``storage_blocks``: the
    prefetch plan). ``host_num_blocks`` is the deepest hit that needs no prefetch at all."""

    num_blocks: int
    start_block: int
    partition: Hashable
    kv_slots: list[int] = field(default_factory=list)
    storage_blocks: list[int] = field(default_factory=list)
    mamba_slot: int = NO_SLOT
    mamba_in_storage: bool = False
    host_num_blocks: int = 0
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
    """What one pending load locked, recorded at lock time and never re-derived (#27147):
    ``kv_node`` and its whole path hold one ``kv_lock`` each, ``mamba_node`` one
    ``mamba_lock``."""

    kv_node: Node | None
    mamba_node: Node | None
    released: bool = False


class HybridRadixTree(_TreeMaintenance):
    """Tiered prefix index for hybrid (attention + Mamba) models. Owns both host pools."""

    def __init__(self, host_kv_capacity: int, host_mamba_capacity: int) -> None:
        self.kv_pool = SlotPool(host_kv_capacity)
        self.mamba_pool = SlotPool(host_mamba_capacity)
        self.roots: dict[Hashable, Node] = {}
        # LRU of nodes whose host KV may be evicted. A touch moves the node *and then its
        # ancestors* to the MRU end, so descendants always precede ancestors and the head is
        # a host leaf: evicting it never strands host KV below it.
        self.kv_lru: OrderedDict[Node, None] = OrderedDict()
        # LRU of evictable host Mamba states; touched only for the state a hit consumes
        # (refreshing the whole path evicts whole sessions under Mamba pressure, #31643).
        self.mamba_lru: OrderedDict[Node, None] = OrderedDict()
        self.pending_kv: dict[int, tuple[Node, int]] = {}
        self.pending_mamba: dict[int, Node] = {}
        self.handles: set[LockHandle] = set()
        # Held nodes that a reset() condemned: never matched, dropped when released.
        self.doomed: set[Node] = set()
        # Split halves that may have stopped being held: settled before the call returns.
        self._dirty: list[Node] = []
        self.num_nodes = 0
        self._clock = 0
        self.counters: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "kv_evicted", "mamba_evicted", "kv_cascaded", "mamba_cascaded",
             "alloc_failures", "stores_committed", "stores_rolled_back", "stale_completions"),
            0,
        )  # fmt: skip

    # ------------------------------------------------------------------ lookups
    def match(
        self,
        hashes: Sequence[bytes],
        partition: Hashable = None,
        start_block: int = 0,
        max_blocks: int | None = None,
    ) -> MatchResult:
        """Deepest ``n`` in ``(start_block, max_blocks]`` with every block of
        ``[start_block, n)`` loadable (host or storage) and a host/storage Mamba state at
        exactly ``n``. Blocks below ``start_block`` are vLLM's own GPU hit: only their keys
        must be in the tree. Refreshes the KV LRU of the hit path and the Mamba LRU of the
        consumed state only."""
        limit = len(hashes) if max_blocks is None else min(max_blocks, len(hashes))
        res = MatchResult(0, start_block, partition)
        node = self.roots.get(partition)
        best = best_host = None
        pos, all_host = 0, True
        while node is not None and pos < limit:
            child = node.children.get(hashes[pos])
            if child is None or (self.doomed and child in self.doomed):
                break
            size = len(child.hashes)
            k = _common(child.hashes, hashes, pos, min(size, limit - pos))
            child.hits += 1
            lo = start_block - pos
            if lo < k and child.n_load != size:
                i, flags = max(lo, 0), child.flags
                while i < k and flags[i] & LOADABLE:
                    i += 1
                if i < k:
                    break
            if all_host and lo < k and child.n_host != size:
                all_host = all(f & HOST for f in child.flags[max(lo, 0) : k])
            if k < size:
                break
            pos += size
            node = child
            if pos > start_block and child.mamba & LOADABLE:
                best = child
                if all_host and child.mamba & HOST:
                    best_host = child
        if best is None:
            self.counters["misses"] += 1
            return res
        self.counters["hits"] += 1
        res.num_blocks, res._node = best.end, best
        if best_host is not None:
            res.host_num_blocks, res._host_node = best_host.end, best_host
        if best.mamba & HOST:
            res.mamba_slot = best.mamba_slot
            self._sync_mamba(best, touch=True)
        else:
            res.mamba_in_storage = True
        path: list[Node] = []
        x: Node = best
        while x.parent is not None and x.end > start_block:
            path.append(x)
            x = x.parent
        for x in reversed(path):
            for i in range(max(start_block - x.start, 0), len(x.hashes)):
                if x.flags[i] & HOST:
                    res.kv_slots.append(x.slots[i])  # type: ignore[index]
                else:
                    res.kv_slots.append(NO_SLOT)
                    res.storage_blocks.append(x.start + i)
        self._touch_kv_path(best)
        return res

    def hit_count(self, hashes: Sequence[bytes], partition: Hashable, block_index: int) -> int:
        """How many matches walked through block ``block_index`` (selective write-through)."""
        found = self._locate(hashes, partition, block_index + 1)
        return 0 if found is None else found[0].hits

    # ------------------------------------------------------------------ loads
    def lock(self, result: MatchResult, host_only: bool = False) -> LockHandle | None:
        """Protect exactly what the load of ``result`` reads; None if the result went stale
        (call it right after ``match``). ``host_only`` locks the ``host_num_blocks`` hit."""
        node = result._host_node if host_only else result._node
        if node is None or node.parent is None or not node.mamba & LOADABLE:
            return None
        x = node
        while x.parent is not None:
            x.kv_lock += 1
            self.kv_lru.pop(x, None)
            x = x.parent
        handle = LockHandle(node, None)
        if node.mamba & HOST:
            node.mamba_lock += 1
            self.mamba_lru.pop(node, None)
            handle.mamba_node = node
        self.handles.add(handle)
        return handle

    def unlock(self, handle: LockHandle) -> None:
        """Release exactly what ``handle`` locked (load finished or aborted)."""
        if handle.released or handle not in self.handles:
            raise RuntimeError("unlock of a handle that is not held")
        handle.released = True
        self.handles.discard(handle)
        x = handle.kv_node
        while x is not None and x.parent is not None:
            assert x.kv_lock > 0, "kv_lock underflow"
            x.kv_lock -= 1
            x = x.parent
        if handle.mamba_node is not None:
            assert handle.mamba_node.mamba_lock > 0, "mamba_lock underflow"
            handle.mamba_node.mamba_lock -= 1
        if handle.kv_node is not None:
            self._settle(handle.kv_node)

    complete_load = unlock

    # ------------------------------------------------------------------ stores
    def reserve_kv(
        self,
        hashes: Sequence[bytes],
        partition: Hashable,
        block_index: int,
        from_device: bool = True,
    ) -> int | None:
        """A host slot to store block ``block_index`` into, or None (already on host or in
        flight, or no evictable space). ``from_device``: the request holds blocks
        ``0..block_index`` on GPU now, so they are marked GPU where the tree knew no tier."""
        if not 0 <= block_index < len(hashes):
            raise IndexError(block_index)
        found = self._locate(hashes, partition, block_index + 1)
        if found is not None and found[0].flags[found[1]] & (HOST | PENDING):
            return None
        slot = self._alloc(self.kv_pool, self.evict_host)
        if slot is None:
            return None
        node = self._insert_path(hashes, partition, block_index + 1, boundary=False)
        i = block_index - node.start
        if from_device:
            self._fill_absent(node, i, GPU)
        node.set_flag(i, node.flags[i] | PENDING | (GPU if from_device else 0))
        node.set_slot(i, slot)
        self.pending_kv[slot] = (node, i)
        self.kv_lru.pop(node, None)
        self._flush()
        return slot

    def reserve_mamba(
        self,
        hashes: Sequence[bytes],
        partition: Hashable,
        num_blocks: int,
        from_device: bool = True,
    ) -> int | None:
        """A host slot for the Mamba state at boundary ``num_blocks``, or None."""
        if not 1 <= num_blocks <= len(hashes):
            raise IndexError(num_blocks)
        found = self._locate(hashes, partition, num_blocks)
        if found is not None and found[0].end == num_blocks and found[0].mamba & (HOST | PENDING):
            return None
        slot = self._alloc(self.mamba_pool, self.evict_host_mamba)
        if slot is None:
            return None
        node = self._insert_path(hashes, partition, num_blocks, boundary=True)
        if from_device:
            self._fill_absent(node, len(node.hashes), GPU)
        node.mamba |= PENDING
        node.mamba_slot = slot
        node.tombstone = False
        self.pending_mamba[slot] = node
        self._flush()
        return slot

    def complete_store(
        self, kv_slots: Iterable[int] = (), mamba_slots: Iterable[int] = (), ok: bool = True
    ) -> None:
        """Commit (``ok``) or roll back reserved slots. Unknown slots are counted, ignored."""
        touched: dict[int, Node] = {}
        for slot in kv_slots:
            entry = self.pending_kv.pop(slot, None)
            if entry is None:
                self.counters["stale_completions"] += 1
                continue
            node, i = entry
            flag = node.flags[i] & ~PENDING
            if ok:
                flag |= HOST
            else:
                node.set_slot(i, NO_SLOT)
                self.kv_pool.free(slot)
            node.set_flag(i, flag)
            touched[id(node)] = node
            self.counters["stores_committed" if ok else "stores_rolled_back"] += 1
        for slot in mamba_slots:
            mnode = self.pending_mamba.pop(slot, None)
            if mnode is None:
                self.counters["stale_completions"] += 1
                continue
            mnode.mamba &= ~PENDING
            if ok:
                mnode.mamba |= HOST
                self._sync_mamba(mnode, touch=True)
            else:
                mnode.mamba_slot = NO_SLOT
                self.mamba_pool.free(slot)
            touched[id(mnode)] = mnode
            self.counters["stores_committed" if ok else "stores_rolled_back"] += 1
        for node in touched.values():
            if node.parent is not None:
                self._settle(node)

    # ------------------------------------------------------------------ eviction
    def evict_host(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` host KV slots (whole LRU host leaves, plus whatever
        becomes dead below them); returns how many were freed (less if nothing evictable)."""
        freed = 0
        while freed < num_blocks and self.kv_lru:
            x = next(iter(self.kv_lru))
            del self.kv_lru[x]
            for i, f in enumerate(x.flags):
                if f & HOST:
                    self.kv_pool.free(x.slots[i])  # type: ignore[index]
                    x.slots[i] = NO_SLOT  # type: ignore[index]
                    x.set_flag(i, f & ~HOST)
                    freed += 1
                    self.counters["kv_evicted"] += 1
            hole = x.flags.find(0)
            if hole >= 0:
                freed += self._kill_from(x, hole + 1)
        return freed

    def evict_host_mamba(self, num_states: int) -> int:
        """Free up to ``num_states`` LRU host Mamba states, leaving tombstones."""
        freed = 0
        while freed < num_states and self.mamba_lru:
            x = next(iter(self.mamba_lru))
            del self.mamba_lru[x]
            self.mamba_pool.free(x.mamba_slot)
            x.mamba_slot = NO_SLOT
            x.mamba &= ~HOST
            x.tombstone = True
            freed += 1
            self.counters["mamba_evicted"] += 1
            self._prune(x)
        return freed

    def reset(self) -> None:
        """Forget every tier of every block (e.g. new weights): what is not held goes now;
        held nodes stop matching and go when released, so in-flight loads and stores stay
        safe and nothing cached before the reset is ever served after it."""
        for root in list(self.roots.values()):
            for child in list(root.children.values()):
                if child.parent is not None:
                    self._kill_from(child, 0)
        self.doomed.update(x for x in self.iter_nodes() if x.held)

    # ------------------------------------------------------------------ GPU / storage mirror
    def mark_device(
        self, hashes: Sequence[bytes], partition: Hashable, num_blocks: int, mamba: bool = False
    ) -> None:
        """Blocks ``[0, num_blocks)`` are in vLLM's paged cache (and the state at
        ``num_blocks`` too when ``mamba``)."""
        self._mark(hashes, partition, num_blocks, GPU, mamba)

    def evict_device(
        self,
        hashes: Sequence[bytes],
        partition: Hashable,
        start_block: int = 0,
        end_block: int | None = None,
    ) -> None:
        """vLLM dropped blocks ``[start_block, end_block)`` (and states ending in that range)."""
        self._clear(hashes, partition, start_block, end_block, GPU)

    def mark_storage(
        self, hashes: Sequence[bytes], partition: Hashable, num_blocks: int, mamba: bool = False
    ) -> None:
        """Storage holds blocks ``[0, num_blocks)`` (a contiguous hit, as LMCache reports)."""
        self._mark(hashes, partition, num_blocks, STORAGE, mamba)

    def evict_storage(
        self,
        hashes: Sequence[bytes],
        partition: Hashable,
        start_block: int = 0,
        end_block: int | None = None,
    ) -> None:
        self._clear(hashes, partition, start_block, end_block, STORAGE)

    def stats(self) -> dict[str, int]:
        return {
            "host_kv_used": self.kv_pool.num_used,
            "host_kv_free": self.kv_pool.num_free,
            "host_mamba_used": self.mamba_pool.num_used,
            "host_mamba_free": self.mamba_pool.num_free,
            "nodes": self.num_nodes,
            "locks": len(self.handles),
            "pending_stores": len(self.pending_kv) + len(self.pending_mamba),
            **self.counters,
        }

    def iter_nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children."""
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            x = stack.pop()
            yield x
            stack.extend(x.children.values())
