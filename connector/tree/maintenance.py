"""Keeping the tree consistent after a change: the invariant-P cascade and the node budget.

Invariant P (liveness is prefix-closed) is what makes dead memory impossible: for every
node that nothing holds (no lock or pin, no pending store), every block with a tier and the
Mamba state at its end have *every* earlier block of their path in some tier. When a block
loses its last tier, ``kill_from`` drops everything after it that is not held, at once; held
nodes are revalidated when released (``settle``), and so are the pieces of a split held node
(``flush`` drains ``Forest.dirty``). ``prune`` detaches the empty unheld leaves this leaves.

Invariant B (the node budget): after every public call, either the node count is within
``max_nodes`` or no node is a metadata leaf. ``trim`` keeps it by dropping the least recently
seen metadata leaves (GPU / STORAGE marks only, nothing held), which frees no bytes: host
content, pending stores, locked and pinned paths are never dropped by it.

``Maintenance`` holds no state of its own: the tree owns it and hands it the forest, the
allocators, the policy and the counters it updates, so every slot it frees is visible to the
same conservation check as every slot the tree allocates.
"""

from __future__ import annotations

from typing import Any

from .counters import TreeCounters
from .eviction import EvictionPolicy, kv_evictable
from .forest import Forest, is_retired
from .node import HOST, NO_SLOT, Node
from .slot_allocator import SlotAllocator


class Maintenance:
    """The cascade (invariant P), pruning and trimming (invariant B) of one tree."""

    def __init__(
        self,
        forest: Forest,
        kv_slots: SlotAllocator,
        mamba_slots: SlotAllocator,
        policy: EvictionPolicy,
        counters: TreeCounters,
    ) -> None:
        self.forest = forest
        self.kv_slots = kv_slots
        self.mamba_slots = mamba_slots
        self.policy = policy
        self.counters = counters
        self.observer: Any = None  # the tree's HostObserver (set_observer), told of freed slots

    def kill_from(self, node: Node, first: int) -> int:
        """Drop every tier of blocks ``node[first:]``, the state at its end and the whole
        subtree, except what is held. Returns the number of host KV slots freed."""
        freed = 0
        doomed, policy = self.forest.doomed, self.policy
        stack, seen = [(node, first)], []
        while stack:
            x, i = stack.pop()
            seen.append(x)
            if not x.held:
                if not i and doomed:
                    doomed.discard(x)  # all of it goes now: the reset is carried out
                # Set aside by a reset: announced gone then (a fresh path may hold its hashes).
                obs = None if is_retired(x) else self.observer
                flags = x.flags
                for j in range(i, len(flags) if x.n_live else i):
                    f = flags[j]
                    if f & HOST:
                        self.kv_slots.free(x.slots[j])  # type: ignore[index]
                        x.slots[j] = NO_SLOT  # type: ignore[index]
                        freed += 1
                        if obs is not None:
                            obs.host_kv(False, x.hashes[j])
                    if f:
                        x.set_flag(j, 0)
                if x.mamba:
                    if x.mamba & HOST:
                        self.mamba_slots.free(x.mamba_slot)
                        x.mamba_slot = NO_SLOT
                        self.counters.mamba_cascaded += 1
                        if obs is not None:
                            obs.host_state(False, x.hashes[-1])
                    x.mamba = 0
                    policy.sync_mamba(x)
                if not kv_evictable(x):
                    policy.withdraw_kv(x)
            stack.extend((c, 0) for c in x.child_nodes())
        self.counters.kv_cascaded += freed
        for x in reversed(seen):
            self.prune(x)
        return freed

    def prune(self, x: Node) -> None:
        """Detach ``x`` and its ancestors while they are empty, unheld leaves; offer the
        node where that stops to the trim order (it may be a metadata leaf now)."""
        while (
            x.parent is not None and x.kids is None and not x.n_live and not x.mamba and not x.held
        ):
            parent = self.forest.detach(x)
            self.policy.forget(x)
            x = parent
        if x.parent is not None:
            self.policy.offer(x)

    def hold_path(self, node: Node) -> None:
        """kv-lock ``node`` and every ancestor: no eviction, cascade or trim touches them."""
        x = node
        while x.parent is not None:
            x.kv_lock += 1
            self.policy.withdraw_kv(x)
            x = x.parent

    def unhold_path(self, node: Node) -> None:
        """Undo one ``hold_path(node)``; the caller then ``settle``s ``node``."""
        x: Node | None = node
        while x is not None and x.parent is not None:
            assert x.kv_lock > 0, "kv_lock underflow"
            x.kv_lock -= 1
            x = x.parent

    def settle(self, node: Node) -> list[Node]:
        """``node`` may have stopped being held: enforce invariant P on its path (drop it if
        a block above it lost every tier meanwhile), prune, and put it back in the LRUs.
        Returns the path it checked (``node`` up to the root's child)."""
        path: list[Node] = []
        x = node
        while x.parent is not None:
            path.append(x)
            x = x.parent
        doomed = self.forest.doomed
        for x in reversed(path):
            if doomed and x in doomed and not x.held:
                doomed.discard(x)
                self.kill_from(x, 0)
                break
            if x.n_live < len(x.hashes):
                self.kill_from(x, x.flags.find(0) + 1)
                break
        if node.parent is not None:
            self.prune(node)
        for x in path:
            if x.parent is not None:
                self.policy.sync_mamba(x)
                self.policy.touch_path(x)
                break
        return path

    def flush(self) -> None:
        """Settle every split tail queued during the call, deepest first, each path once
        (a mark that splits a long node at every block must stay linear)."""
        dirty = self.forest.dirty
        if not dirty:
            return
        todo = sorted(set(dirty), key=lambda n: -n.start)
        dirty.clear()
        done: set[int] = set()
        for x in todo:
            if x.parent is not None and id(x) not in done:
                done.update(map(id, self.settle(x)))

    def trim(self, max_nodes: int) -> None:
        """Drop least recently seen metadata leaves until the budget holds (invariant B)."""
        forest = self.forest
        while forest.num_nodes > max_nodes:
            x = self.policy.trim_victim()
            if x is None:
                return
            parent = forest.detach(x)
            self.policy.forget(x)
            self.counters.nodes_trimmed += 1
            self.prune(parent)
