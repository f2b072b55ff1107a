"""Freeing host slots: the one place where bytes leave the CPU tier to make room.

Why its own object: every freed slot must do the same four things (write back first if the
policy asks, clear the host bit, tell the observer, keep invariant P by cascading from a
block that lost its last tier), whether the slot goes to LRU eviction of a block, of a Mamba
state, or to a request's newer decode state replacing its older one. Reservations ask it for
a slot (``alloc_kv`` / ``alloc_state``), evicting one victim when none is free.

KV blocks go one at a time from the end of the least recently used host leaf, so a
conversation keeps its earlier blocks; a state goes whole and leaves a tombstone (its node
may still serve KV) unless storage holds it. Like ``Maintenance`` it owns nothing: the tree
hands it the allocators, policy, maintenance and counters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .eviction import EvictionPolicy
from .maintenance import Maintenance
from .node import HOST, NO_SLOT, STORAGE, Node
from .slot_allocator import SlotAllocator

# Called for a host block (``is_state`` False) or a host Mamba state (True) that LRU eviction is
# about to free and that storage does not hold yet: (is_state, host slot, key hash) -> whether
# its bytes will be written to storage before the slot is reused (write-back). If so, the tree
# keeps it as a storage entry instead of losing it.
WriteBack = Callable[[bool, int, bytes], bool]


class HostEviction:
    """LRU eviction and slot freeing for one tree's host tier."""

    def __init__(
        self,
        kv_slots: SlotAllocator,
        mamba_slots: SlotAllocator,
        policy: EvictionPolicy,
        maint: Maintenance,
        counters: dict[str, int],
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

    def alloc_state(self) -> int | None:
        return self._alloc(self.mamba_slots, self.evict_states)

    def _alloc(self, slots: SlotAllocator, evict: Callable[[int], int]) -> int | None:
        """A free slot, evicting one victim first if there is none."""
        slot = slots.alloc()
        if slot is None:
            evict(1)
            slot = slots.alloc()
        if slot is None:
            self.counters["alloc_failures"] += 1
        return slot

    # ------------------------------------------------------------------ eviction
    def evict_kv(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` host KV slots from the LRU leaves' ends; how many were."""
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
                    if wb is not None and not f & STORAGE and wb(False, slots[i], x.hashes[i]):
                        f |= STORAGE  # written back before the slot is reused: still live
                        self.counters["kv_written_back"] += 1
                    self.kv_slots.free(slots[i])
                    slots[i] = NO_SLOT
                    x.set_flag(i, f & ~HOST)
                    freed += 1
                    if obs is not None:
                        obs.host_kv(False, x.hashes[i])
                    self.counters["kv_evicted"] += 1
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
            if wb is not None and not x.mamba & STORAGE and wb(True, x.mamba_slot, x.hashes[-1]):
                x.mamba |= STORAGE
                self.counters["mamba_written_back"] += 1
            self.free_state(x, tombstone=not x.mamba & STORAGE)
            freed += 1
            self.counters["mamba_evicted"] += 1
        return freed

    def free_state(self, x: Node, tombstone: bool) -> None:
        """Free ``x``'s host state now, leaving a tombstone or not (the caller's rule)."""
        self.mamba_slots.free(x.mamba_slot)
        x.mamba_slot = NO_SLOT
        x.mamba &= ~HOST
        x.tombstone = tombstone
        if self.observer is not None:
            self.observer.host_state(False, x.hashes[-1])
        self.policy.sync_mamba(x)
        self.maint.prune(x)
