"""Loads and prefetch pins: what a lock protects is recorded in its handle at lock time and
released exactly (never re-derived, sgl-project/sglang#27147). A kv-locked node is in no
eviction order, and no cascade or trim touches it, so its host KV keeps its slots until the
handle is released."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from .eviction import EvictionPolicy
from .forest import Forest
from .maintenance import Maintenance
from .node import HOST, LOADABLE, Node
from .results import LockHandle, MatchResult


class PathLocks:
    """The live handles and the lock counts they hold on the tree's nodes."""

    def __init__(self, forest: Forest, policy: EvictionPolicy, maint: Maintenance) -> None:
        self.forest, self.policy, self.maint = forest, policy, maint
        self.handles: set[LockHandle] = set()

    def lock(
        self, result: MatchResult, host_only: bool = False, count_hit: bool = True
    ) -> LockHandle | None:
        """Protect exactly what the load of ``result`` reads; None if the result went stale
        (call it right after ``match``). ``host_only`` locks the ``host_num_blocks`` hit.

        ``count_hit``: this lock is a new use of the path (one per load of a request), so
        every node on it gains a hit, which ``hot_objects`` compares with its threshold. A
        caller that locks again for the same request (a retried lookup while a storage
        probe is pending, after a preemption) passes False, or hits would count retries."""
        node = result._host_node if host_only else result._node
        if node is None or node.parent is None or not node.mamba & LOADABLE:
            return None
        handle = self._lock(node, state=True, pinned=False)
        if count_hit:
            x = node
            while x.parent is not None:
                x.hits += 1
                x = x.parent
        return handle

    def pin(self, hashes: Sequence[bytes], partition: Hashable, num_blocks: int) -> LockHandle:
        """Keep blocks ``[0, num_blocks)`` where they are while a prefetch fills the rest:
        kv-lock the node holding block ``num_blocks - 1`` and all its ancestors (and the host
        state at ``num_blocks`` if one is there; none is needed). While pinned, no host KV on
        that path is evicted and no node on it is cascaded or trimmed, so reserving slots for
        the storage-only blocks can never evict the host prefix they extend. Host states at
        shallower boundaries stay evictable: pin the boundary the request will load (a
        narrower pin, then ``unlock`` of the wider one, when a planner falls back).
        Release with ``unlock``.

        Raises ``KeyError`` if the tree has no such path (pin what ``match`` just found)."""
        if not 1 <= num_blocks <= len(hashes):
            raise IndexError(num_blocks)
        found = self.forest.locate(hashes, partition, num_blocks)
        if found is None:
            raise KeyError("pin: blocks [0, num_blocks) are not in the tree")
        node = found[0]
        return self._lock(node, state=node.end == num_blocks, pinned=True)

    def _lock(self, node: Node, state: bool, pinned: bool) -> LockHandle:
        self.maint.hold_path(node)
        handle = LockHandle(node, None, pinned)
        if state and node.mamba & HOST:
            node.mamba_lock += 1
            self.policy.sync_mamba(node)
            handle.mamba_node = node
        self.handles.add(handle)
        return handle

    def unlock(self, handle: LockHandle) -> None:
        """Release exactly what ``handle`` locked (load finished or aborted, pin dropped); the
        tree then restores its invariants."""
        if handle.released or handle not in self.handles:
            raise RuntimeError("unlock of a handle that is not held")
        handle.released = True
        self.handles.discard(handle)
        if handle.kv_node is not None:
            self.maint.unhold_path(handle.kv_node)
        if handle.mamba_node is not None:
            assert handle.mamba_node.mamba_lock > 0, "mamba_lock underflow"
            handle.mamba_node.mamba_lock -= 1
        if handle.kv_node is not None:
            self.maint.settle(handle.kv_node)
