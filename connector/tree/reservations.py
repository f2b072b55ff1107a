"""Stores into the host tier: reserving slots for blocks and states, then commit or rollback.

A store is two calls apart: the scheduler reserves a slot while it builds a step plan (the
block or state becomes ``PENDING``: held, unmatchable, listed in the forest's pending maps),
and the worker's copy finishing commits it (``HOST``) or rolls it back (slot freed). Between
the two, the slot belongs to the store and nothing else may touch it.

A request storing its newest blocks must not pay for them with its own older ones: host
eviction takes the end of the least recently used host leaf, which is often the very request
that is storing. So ``reserve_kv_run`` holds the request's path ``[0, end)`` for the length
of the call (like a pin) and only other paths are victims; with none left, the run stops.

Like ``Maintenance`` and ``HostEviction`` it owns nothing: the tree hands it the forest, the
allocators, the evictor and the counters, and finishes every public call itself.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from itertools import groupby, repeat
from operator import itemgetter
from typing import Any

from .counters import TreeCounters
from .eviction import EvictionPolicy
from .forest import Forest, is_retired
from .host_eviction import HostEviction
from .maintenance import Maintenance
from .node import COMMIT, GPU, HOST, NO_SLOT, PENDING, ROLLBACK, Node
from .results import StoreCursor
from .slot_allocator import SlotAllocator
from .tier_marks import fill_absent, mark_gpu_up


class Reservations:
    """Reserve, commit and roll back host stores of one tree."""

    def __init__(
        self,
        forest: Forest,
        kv_slots: SlotAllocator,
        mamba_slots: SlotAllocator,
        policy: EvictionPolicy,
        maint: Maintenance,
        evictor: HostEviction,
        counters: TreeCounters,
    ) -> None:
        self.forest = forest
        self.kv_slots = kv_slots
        self.mamba_slots = mamba_slots
        self.policy = policy
        self.maint = maint
        self.evictor = evictor
        self.counters = counters
        self.observer: Any = None  # the tree's HostObserver, told of committed stores

    def reserve_kv(
        self, hashes: Sequence[bytes], partition: Hashable, block_index: int, from_device: bool
    ) -> int | None:
        """See ``HybridRadixTree.reserve_kv``."""
        if not 0 <= block_index < len(hashes):
            raise IndexError(block_index)
        found = self.forest.locate(hashes, partition, block_index + 1)
        if found is not None and found[0].flags[found[1]] & (HOST | PENDING):
            return None
        slot = self.evictor.alloc_kv()
        if slot is None:
            return None
        node = self.forest.ensure_path(hashes, partition, block_index + 1)[-1]
        i = block_index - node.start
        if from_device:
            fill_absent(node, i, GPU)
        node.set_flag(i, node.flags[i] | PENDING | (GPU if from_device else 0))
        node.set_slot(i, slot)
        self.forest.pend_one(slot, node, i)
        self.policy.withdraw_kv(node)
        return slot

    def reserve_kv_run(
        self,
        hashes: Sequence[bytes],
        partition: Hashable,
        start: int,
        end: int,
        commit_settles: bool = False,
        cursor: StoreCursor | None = None,
    ) -> list[tuple[int, int]]:
        """See ``HybridRadixTree.reserve_kv_run``."""
        if not 0 <= start < end <= len(hashes):
            raise IndexError((start, end))
        forest = self.forest
        tail = None if cursor is None else forest.on_path(cursor.node, hashes, partition, start)
        if cursor is not None:
            origin = tail if start else forest.roots.get(partition)
            if origin is not None:
                fast = self._new_leaf_run(origin, hashes, partition, start, end)
                if fast is None and tail is not None:
                    fast = self._grown_leaf_run(tail, hashes, start, end)
                if fast is not None:
                    cursor.node = fast[0]
                    if not commit_settles:
                        self.maint.settle(fast[0])
                    return fast[1]
        if tail is None:
            path = forest.ensure_path(hashes, partition, end)
        else:
            # The previous run's node: it and its ancestors are marked GPU as the walk from
            # the root would have marked them; the walk starts after it.
            mark_gpu_up(tail)
            path = forest.ensure_path(hashes, partition, end, (), tail)
        for x in path:
            upto = min(len(x.hashes), end - x.start)
            if x.n_gpu < upto:
                x.mark_gpu(upto)
        own = path[-1]
        if cursor is not None:
            cursor.node = own
        # The request's own blocks are no victims of its stores. With enough free slots
        # nothing is evicted, so there is nothing to hold them against.
        hold = self.kv_slots.num_free < end - start
        if hold:
            self.maint.hold_path(own)
        out: list[tuple[int, int]] = []
        try:
            out = self._reserve_run(path, start, end)
            return out
        finally:
            if hold:
                self.maint.unhold_path(own)
            # A slot reserved in ``own`` makes the commit settle ``own`` (and so its path).
            if not (commit_settles and out and out[-1][0] >= own.start):
                self.maint.settle(own)

    def _new_leaf_run(
        self, origin: Node, hashes: Sequence[bytes], partition: Hashable, start: int, end: int
    ) -> tuple[Node, list[tuple[int, int]]] | None:
        """The usual run of a request that stores as it computes: nothing of ``[start, end)``
        is in the tree yet, ``origin`` (its previous run's node, or the root when ``start``
        is 0) cannot grow in place, and there are free slots for every block. Then the run
        is one new leaf, all of it stored: built in one step, the shape, flags and slots
        equal to what the general walk leaves. None: not that case (nothing changed)."""
        n = end - start
        if (
            origin.child(hashes[start]) is not None
            or (origin.parent is not None and origin.kids is None and not origin.mamba)
            or self.kv_slots.num_free < n
        ):
            return None
        mark_gpu_up(origin)
        slots = self.kv_slots.alloc_many(n)
        leaf = Node(origin, partition, start, list(hashes[start:end]))
        leaf.reserve_new(slots)
        origin.add_child(leaf)
        self.forest.num_nodes += 1
        self.forest.pend_span(leaf, 0, slots)
        return leaf, list(zip(range(start, end), slots, strict=True))

    def _grown_leaf_run(
        self, tail: Node, hashes: Sequence[bytes], start: int, end: int
    ) -> tuple[Node, list[tuple[int, int]]] | None:
        """The other usual run: the request's previous run ended in a leaf that keeps no
        state (the state budget skipped that chunk end), so the general walk would grow that
        leaf in place. ``tail`` ends at ``start`` (the caller checked it with ``on_path``);
        with free slots for every block the run is that leaf grown by ``[start, end)``, all
        of it stored, equal to what the general walk leaves. None: not that case."""
        n = end - start
        if tail.kids is not None or tail.mamba or self.kv_slots.num_free < n:
            return None
        mark_gpu_up(tail)
        slots = self.kv_slots.alloc_many(n)
        i = len(tail.hashes)
        tail.grow_reserved(list(hashes[start:end]), slots)
        tail.tombstone = False
        self.forest.pend_span(tail, i, slots)
        self.policy.withdraw_kv(tail)  # a pending block makes the node no victim
        return tail, list(zip(range(start, end), slots, strict=True))

    def _reserve_run(self, path: list[Node], start: int, end: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        pend_one = self.forest.pend_one
        for x in path:
            if x.end <= start:
                continue
            flags = x.flags
            lo, hi = max(start - x.start, 0), min(len(flags), end - x.start)
            if lo < hi and not x.any_slot(lo, hi):
                # The usual run: every block of the span is new to the host tier.
                slots = self.evictor.alloc_kv_many(hi - lo)
                n = len(slots)
                if n:
                    x.reserve_span(lo, slots)
                    self.forest.pend_span(x, lo, slots)
                    out.extend(zip(range(x.start + lo, x.start + lo + n), slots, strict=True))
                    self.policy.withdraw_kv(x)
                if n < hi - lo:
                    return out
                continue
            wanted = [i for i in range(lo, hi) if not flags[i] & (HOST | PENDING)]
            if not wanted:
                continue
            slots = self.evictor.alloc_kv_many(len(wanted))
            if slots:
                got = wanted[: len(slots)]
                x.reserve(got, slots)
                for i, slot in zip(got, slots, strict=True):
                    pend_one(slot, x, i)
                    out.append((x.start + i, slot))
                self.policy.withdraw_kv(x)  # a pending block makes the node no victim
            if len(slots) < len(wanted):
                return out  # the tier is full: the caller retries the rest next step
        return out

    def reserve_mamba(
        self,
        hashes: Sequence[bytes],
        partition: Hashable,
        num_blocks: int,
        from_device: bool,
        cursor: StoreCursor | None = None,
    ) -> int | None:
        """See ``HybridRadixTree.reserve_mamba``."""
        if not 1 <= num_blocks <= len(hashes):
            raise IndexError(num_blocks)
        forest = self.forest
        at = None if cursor is None else forest.on_path(cursor.node, hashes, partition, num_blocks)
        x = at
        if x is None:  # no cursor to trust: find the node ending there, if any
            found = forest.locate(hashes, partition, num_blocks)
            x = found[0] if found is not None and found[0].end == num_blocks else None
        if x is not None and x.mamba & (HOST | PENDING):
            return None
        slot = self.evictor.alloc_state()
        if slot is None:
            return None
        # The allocation may have evicted: the node is trusted only if it still ends there.
        node = forest.on_path(at, hashes, partition, num_blocks)
        if node is None:
            node = forest.ensure_path(hashes, partition, num_blocks, (num_blocks,))[-1]
        if cursor is not None:
            cursor.node = node
        if from_device:
            fill_absent(node, len(node.hashes), GPU)
        node.mamba |= PENDING
        node.seal()
        node.mamba_slot = slot
        node.tombstone = False
        self.forest.pending_mamba[slot] = node
        return slot

    def complete(self, kv_slots: Iterable[int], mamba_slots: Iterable[int], ok: bool) -> None:
        """See ``HybridRadixTree.complete_store``."""
        touched: dict[int, Node] = {}
        run_nodes: dict[int, Node] = {}
        run_lo = 0
        done = 0
        pending_mamba = self.forest.pending_mamba
        obs = self.observer
        slots = kv_slots if isinstance(kv_slots, list) else list(kv_slots)
        if ok:
            # A plan's own runs, committed in the call that built it: span by span, no map.
            runs, run_lo, run_hi = self.forest.take_runs(slots)
            for node, first, run_slots in runs:
                end = first + len(run_slots)
                node.retag(first, end, COMMIT)
                if obs is not None and not is_retired(node):
                    for h in node.hashes[first:end]:
                        obs.host_kv(True, h)
                run_nodes[id(node)] = node
            if run_hi:
                done += run_hi - run_lo
                slots = slots[:run_lo] + slots[run_hi:]
        entries = list(map(self.forest.pending_kv.pop, slots, repeat(None))) if slots else []
        stale = entries.count(None)
        self.counters.stale_completions += stale
        done += len(entries) - stale
        if not ok:
            for slot, entry in zip(slots, entries, strict=True):
                if entry is not None:
                    entry[0].set_slot(entry[1], NO_SLOT)
                    self.kv_slots.free(slot)
        elif obs is not None:  # a reset's set-aside nodes are silent (``tree.reset``)
            for entry in entries:
                if entry is not None and not is_retired(entry[0]):
                    obs.host_kv(True, entry[0].hashes[entry[1]])
        # A plan lists a run's blocks together: their flags move in one pass per run.
        table = COMMIT if ok else ROLLBACK
        for node, run in groupby(filter(None, entries), key=itemgetter(0)):
            idx = [i for _, i in run]
            lo, hi = min(idx), max(idx) + 1
            if hi - lo == len(idx):  # the indices are unique: this is the whole span
                node.retag(lo, hi, table)
            else:
                f = node.flags
                node.set_flags(idx, bytes([table[f[i]] for i in idx]))
            touched[id(node)] = node
        if run_nodes:  # settled in plan order: slots before the runs, the runs, the rest
            touched = run_nodes | touched if not run_lo else touched | run_nodes
        for slot in mamba_slots:
            mnode = pending_mamba.pop(slot, None)
            if mnode is None:
                self.counters.stale_completions += 1
                continue
            mnode.mamba &= ~PENDING
            if ok:
                mnode.mamba |= HOST
                self.policy.sync_mamba(mnode, touch=True)
                if obs is not None and not is_retired(mnode):
                    obs.host_state(True, mnode.hashes[-1])
            else:
                mnode.mamba_slot = NO_SLOT
                self.mamba_slots.free(slot)
            touched[id(mnode)] = mnode
            done += 1
        if ok:
            self.counters.stores_committed += done
        else:
            self.counters.stores_rolled_back += done
        for node in touched.values():
            if node.parent is not None:
                self.maint.settle(node)
