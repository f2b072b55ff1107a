"""Freeing host slots: the one place where bytes leave the CPU tier to make room.

Why its own object: every freed slot must do the same four things (write back first if the
policy asks, clear the host bit, tell the observer, keep invariant P by cascading from a
block that lost its last tier), whether the slot goes to LRU eviction of a block, of a Mamba
state, or to a request's newer decode state replacing its older one. Reservations ask it for
a slot (``alloc_kv`` / ``alloc_state``), evicting victims when none is free.

A written-back victim's slot is quarantined, not freed (``SlotAllocator.free_later``): the
worker reads it for the storage write during the step plan being built, so handing it to a
store of the same plan would give one slot two roles. It frees nothing usable until the tree's
``seal_plan``, so an allocation evicts further victims, at most ``MAX_VICTIMS_PER_ALLOC``.

KV blocks go one at a time from the end of the least recently used host leaf, so a
conversation keeps its earlier blocks; a state goes whole and leaves a tombstone (its node
may still serve KV) unless storage holds it. Like ``Maintenance`` it owns nothing: the tree
hands it the allocators, policy, maintenance and counters.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from .counters import TreeCounters
from .eviction import EvictionPolicy
from .maintenance import Maintenance
from .node import HOST, NO_SLOT, STORAGE, Node
from .slot_allocator import SlotAllocator

# Called for a host block (``is_state`` False) or a host Mamba state (True) that LRU eviction is
# about to free and that storage does not hold yet: (is_state, host slot, key hash, the node's
# partition) -> whether
# its bytes will be written to storage by the step plan being built (write-back). If so, the
# tree keeps it as a storage entry instead of losing it, and quarantines the slot until
# ``HybridRadixTree.seal_plan``.
WriteBack = Callable[[bool, int, bytes, Hashable], bool]

# Victims one allocation may evict before it fails: under write-back each quarantined victim
# frees nothing this plan, and an unbounded search would write back a whole pool for one slot.
MAX_VICTIMS_PER_ALLOC = 16


class HostEviction:
    """LRU eviction and slot freeing for one tree's host tier."""

    def __init__(
        self,
        kv_slots: SlotAllocator,
        mamba_slots: SlotAllocator,
        policy: EvictionPolicy,
        maint: Maintenance,
        counters: TreeCounters,
    ) -> None:
        self.kv_slots = kv_slots
        self.mamba_slots = mamba_slots
        self.policy = policy
        self.maint = maint
        self.counters = counters
        self.write_back: WriteBack | None = None
        self.observer: Any = None  # the tree's HostObserver

    # ------------------------------------------------------------------ allocation
    def alloc_kv(self) -> int | None:
        return self._alloc(self.kv_slots, self.evict_kv)

    def alloc_kv_many(self, n: int) -> list[int]:
        """Up to ``n`` KV slots: free ones first, then one eviction at a time as ``alloc_kv``
        does; fewer than ``n`` only when ``alloc_kv`` would have failed."""
        out = self.kv_slots.alloc_many(n)
        while len(out) < n:
            slot = self.alloc_kv()
            if slot is None:
                break
            out.append(slot)
        return out

    def alloc_state(self) -> int | None:
        return self._alloc(self.mamba_slots, self.evict_states)

    def _alloc(self, slots: SlotAllocator, evict: Callable[[int], int]) -> int | None:
        """A free slot, evicting victims one at a time while there is none (a quarantined
        victim frees nothing usable yet); None once nothing is evictable or the bound is hit."""
        slot = slots.alloc()
        victims = 0
        while slot is None and victims < MAX_VICTIMS_PER_ALLOC and evict(1):
            victims += 1
            slot = slots.alloc()
        if slot is None:
            self.counters.alloc_failures += 1
        return slot

    # ------------------------------------------------------------------ eviction
    def evict_kv(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` host KV slots from the LRU leaves' ends; how many were
        (a written-back block's slot counts, though it stays quarantined until ``seal_plan``)."""
        freed, obs = 0, self.observer
        while freed < num_blocks:
            x = self.policy.kv_victim()
            if x is None:
                break
            flags, slots = x.flags, x.slots
            assert slots is not None
            i, hole = len(flags), -1
            while freed < num_blocks and x.n_host:
                i -= 1
                f = flags[i]
                if f & HOST:
                    wb = self.write_back
                    if (
                        wb is not None
                        and not f & STORAGE
                        and wb(False, slots[i], x.hashes[i], x.partition)
                    ):
                        f |= STORAGE  # written back before the slot is reused: still live
                        self.counters.kv_written_back += 1
                        self.kv_slots.free_later(slots[i])
                    else:
                        self.kv_slots.free(slots[i])
                    slots[i] = NO_SLOT
                    x.set_flag(i, f & ~HOST)
                    freed += 1
                    if obs is not None:
                        obs.host_kv(False, x.hashes[i])
                    self.counters.kv_evicted += 1
                    if not flags[i]:
                        hole = i  # its last tier: what follows it dies (invariant P)
            if not x.n_host:
                self.policy.withdraw_kv(x)
            if hole >= 0:
                freed += self.maint.kill_from(x, hole + 1)
            elif not x.n_host:
                self.maint.prune(x)  # it may be a metadata leaf now
        return freed

    def evict_states(self, num_states: int) -> int:
        """Free up to ``num_states`` LRU host Mamba states (written back first if asked)."""
        freed = 0
        while freed < num_states:
            x = self.policy.mamba_victim()
            if x is None:
                break
            wb = self.write_back
            later = False
            if (
                wb is not None
                and not x.mamba & STORAGE
                and wb(True, x.mamba_slot, x.hashes[-1], x.partition)
            ):
                x.mamba |= STORAGE
                self.counters.mamba_written_back += 1
                later = True
            self.free_state(x, tombstone=not x.mamba & STORAGE, later=later)
            freed += 1
            self.counters.mamba_evicted += 1
        return freed

    def free_state(self, x: Node, tombstone: bool, later: bool = False) -> None:
        """Free ``x``'s host state, leaving a tombstone or not (the caller's rule); ``later``
        quarantines the slot (the worker reads it for a write-back during this plan)."""
        if later:
            self.mamba_slots.free_later(x.mamba_slot)
        else:
            self.mamba_slots.free(x.mamba_slot)
        x.mamba_slot = NO_SLOT
        x.mamba &= ~HOST
        x.tombstone = tombstone
        if self.observer is not None:
            self.observer.host_state(False, x.hashes[-1])
        self.policy.sync_mamba(x)
        self.maint.prune(x)
