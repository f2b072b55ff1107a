"""Flat index of the pinned-CPU tier: which block hashes and Mamba boundaries have host slots.

vLLM block hashes are chained (hash i encodes tokens 0..i and the request's
extra keys), so a flat map from hash to slot already identifies a prefix. The
radix tree (issue 3) adds structure on top (leaf-first eviction, tombstones,
tiers); this index is the minimal correct form the connector was built on, and
both expose the same calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass
class MatchResult:
    """A usable hybrid hit: KV for blocks [start_block, num_blocks) and the state at num_blocks."""

    start_block: int = 0
    num_blocks: int = 0
    kv_slots: list[int] = field(default_factory=list)
    mamba_slot: int = -1
    _kv_keys: list[tuple] = field(default_factory=list, repr=False)
    _mamba_key: tuple | None = field(default=None, repr=False)

    @property
    def hit(self) -> bool:
        return self.num_blocks > self.start_block


@dataclass
class LockHandle:
    """Remembers exactly which entries it locked, so unlock can never touch others."""

    kv_keys: list[tuple]
    mamba_key: tuple | None
    released: bool = False


@dataclass
class _Entry:
    slot: int
    locks: int = 0


class _LruSlots:
    """Fixed pool of slots with an LRU of committed entries; locked entries are never evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free: list[int] = list(range(capacity - 1, -1, -1))
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.evictions = 0

    def get(self, key: tuple) -> _Entry | None:
        return self.entries.get(key)

    def touch(self, key: tuple) -> None:
        self.entries.move_to_end(key)

    def reserve(self, key: tuple) -> int | None:
        if key in self.entries:
            return None
        if not self.free and not self._evict_one():
            return None
        slot = self.free.pop()
        self.entries[key] = _Entry(slot)
        return slot

    def _evict_one(self) -> bool:
        for key, entry in self.entries.items():
            if entry.locks == 0:
                del self.entries[key]
                self.free.append(entry.slot)
                self.evictions += 1
                return True
        return False

    def drop(self, key: tuple) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry.locks == 0:
            del self.entries[key]
            self.free.append(entry.slot)

    def clear_unlocked(self) -> None:
        for key in [k for k, e in self.entries.items() if e.locks == 0]:
            self.free.append(self.entries.pop(key).slot)

    @property
    def used(self) -> int:
        return self.capacity - len(self.free)


class HostIndex:
    """Host-tier index: KV slots per block hash, Mamba slots per boundary hash."""

    def __init__(self, kv_capacity: int, mamba_capacity: int) -> None:
        self._kv = _LruSlots(kv_capacity)
        self._mamba = _LruSlots(mamba_capacity)

    def match(
        self,
        hashes: Sequence[bytes],
        partition: Hashable = None,
        start_block: int = 0,
        max_blocks: int | None = None,
    ) -> MatchResult:
        """Deepest n in (start_block, max_blocks] with host KV for [start_block, n) and a state at n."""
        limit = len(hashes) if max_blocks is None else min(max_blocks, len(hashes))
        kv_keys: list[tuple] = []
        for i in range(start_block, limit):
            key = (partition, hashes[i])
            if self._kv.get(key) is None:
                break
            kv_keys.append(key)
        for n in range(start_block + len(kv_keys), start_block, -1):
            mkey = (partition, hashes[n - 1])
            mentry = self._mamba.get(mkey)
            if mentry is None:
                continue
            keys = kv_keys[: n - start_block]
            for key in keys:
                self._kv.touch(key)
            self._mamba.touch(mkey)
            return MatchResult(
                start_block=start_block,
                num_blocks=n,
                kv_slots=[self._kv.entries[k].slot for k in keys],
                mamba_slot=mentry.slot,
                _kv_keys=keys,
                _mamba_key=mkey,
            )
        return MatchResult(start_block=start_block, num_blocks=start_block)

    def lock(self, result: MatchResult) -> LockHandle:
        for key in result._kv_keys:
            self._kv.entries[key].locks += 1
        if result._mamba_key is not None:
            self._mamba.entries[result._mamba_key].locks += 1
        return LockHandle(list(result._kv_keys), result._mamba_key)

    def unlock(self, handle: LockHandle) -> None:
        if handle.released:
            return
        handle.released = True
        for key in handle.kv_keys:
            self._kv.entries[key].locks -= 1
        if handle.mamba_key is not None:
            self._mamba.entries[handle.mamba_key].locks -= 1

    def reserve_kv(
        self, hashes: Sequence[bytes], partition: Hashable, block_index: int
    ) -> int | None:
        """A slot for block ``block_index``; None when already cached or nothing can be evicted."""
        return self._kv.reserve((partition, hashes[block_index]))

    def reserve_mamba(
        self, hashes: Sequence[bytes], partition: Hashable, num_blocks: int
    ) -> int | None:
        """A slot for the Mamba state after ``num_blocks`` blocks."""
        return self._mamba.reserve((partition, hashes[num_blocks - 1]))

    def invalidate(self, result_or_handle: LockHandle) -> None:
        """Forget entries whose bytes proved bad (e.g. a failed load)."""
        for key in result_or_handle.kv_keys:
            self._kv.drop(key)
        if result_or_handle.mamba_key is not None:
            self._mamba.drop(result_or_handle.mamba_key)

    def reset(self) -> None:
        """Drop every entry not held by an in-flight load."""
        self._kv.clear_unlocked()
        self._mamba.clear_unlocked()

    def locked_entries(self) -> int:
        """Entries held by a lock; 0 whenever no load is pending or in flight."""
        return sum(e.locks > 0 for e in self._kv.entries.values()) + sum(
            e.locks > 0 for e in self._mamba.entries.values()
        )

    def conserved(self) -> bool:
        """Pool conservation: every slot is either free or owned by exactly one entry."""
        for pool in (self._kv, self._mamba):
            owned = [e.slot for e in pool.entries.values()]
            if len(owned) + len(pool.free) != pool.capacity:
                return False
            if len(set(owned) | set(pool.free)) != pool.capacity:
                return False
        return True

    def stats(self) -> dict[str, int]:
        return {
            "host_kv_used": self._kv.used,
            "host_kv_capacity": self._kv.capacity,
            "host_mamba_used": self._mamba.used,
            "host_mamba_capacity": self._mamba.capacity,
            "host_kv_evictions": self._kv.evictions,
            "host_mamba_evictions": self._mamba.evictions,
        }
