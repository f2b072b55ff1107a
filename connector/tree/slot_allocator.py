"""Free-list allocator of host slot *indices* (KV blocks or Mamba states).

It hands out numbers only; the bytes behind slot ``i`` live in the worker's
``himamba.tiers.cpu_pool.HostSlotPool``. The tree owns both allocators so that conservation
(free + used = capacity) is a property of one object and can be checked after every step; a
separate allocator that the tree only *told* about frees is how the reference leaked slots
(#27489, #9927).
"""

from __future__ import annotations


class SlotAllocator:
    """LIFO free list over ``range(capacity)``; LIFO reuses slots that are still warm in cache."""

    __slots__ = ("capacity", "_free", "_is_free")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.capacity or self._is_free[slot]:
            raise AssertionError(f"double free or foreign slot {slot}")
        self._is_free[slot] = 1
        self._free.append(slot)

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])

    def free_slots(self) -> list[int]:
        return list(self._free)
