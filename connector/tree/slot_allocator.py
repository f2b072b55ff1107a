"""Free-list allocator of host slot *indices* (KV blocks or Mamba states).

It hands out numbers only; the bytes behind slot ``i`` live in the worker's
``himamba.tiers.cpu_pool.HostSlotPool``. The tree owns both allocators so that conservation
(free + quarantined + used = capacity) is a property of one object and can be checked after
every step; a separate allocator that the tree only *told* about frees is how the reference
leaked slots (sgl-project/sglang#27489, sgl-project/sglang#9927).

Two things every free goes through, so no free path of the tree can skip them:

* **Quarantine** (``free_later``): a slot whose bytes the worker still reads during the step
  plan being built (a write-back to storage) must not be handed out again in that same plan,
  or the worker would read one slot in two roles. It stays out of both the free list and the
  used count until ``release_quarantine`` (the tree's ``seal_plan``).
* **Journal** (``journal``): when the worker keeps per-slot state of its own, it must hear of
  every slot the tree gave up, whatever the cause. None (the default) costs one test per free.
"""

from __future__ import annotations

_USED, _FREE, _QUARANTINED = 0, 1, 2


class SlotAllocator:
    """LIFO free list over ``range(capacity)``; LIFO reuses slots that are still warm in cache."""

    __slots__ = ("capacity", "_free", "_state", "_quarantine", "journal")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._state = bytearray([_FREE]) * capacity
        self._quarantine: list[int] = []
        # Every slot freed or quarantined, in order, while not None (drained by the tree).
        self.journal: list[int] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantine)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free) - len(self._quarantine)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._state[slot] = _USED
        return slot

    def alloc_many(self, n: int) -> list[int]:
        """Up to ``n`` free slots, the same ones in the same order as ``n`` calls of ``alloc``
        (fewer when the free list runs out): one slice instead of a call per block."""
        free = self._free
        taken = free[: -n - 1 : -1] if n > 0 else []
        if taken:
            del free[-len(taken) :]
            state = self._state
            for slot in taken:
                state[slot] = _USED
        return taken

    def free(self, slot: int) -> None:
        """Make ``slot`` allocatable now (nothing reads it any more)."""
        self._take_back(slot, _FREE)
        self._free.append(slot)

    def free_later(self, slot: int) -> None:
        """Give ``slot`` up, but allocatable only after ``release_quarantine``: the worker
        still reads it during the step plan being built."""
        self._take_back(slot, _QUARANTINED)
        self._quarantine.append(slot)

    def release_quarantine(self) -> int:
        """Make every quarantined slot allocatable (the plan that read them is sealed);
        returns how many. They were journaled when quarantined, not again here."""
        q = self._quarantine
        for slot in q:
            self._state[slot] = _FREE
        self._free.extend(q)
        n = len(q)
        q.clear()
        return n

    def _take_back(self, slot: int, state: int) -> None:
        if not 0 <= slot < self.capacity or self._state[slot] != _USED:
            raise AssertionError(f"double free or foreign slot {slot}")
        self._state[slot] = state
        if self.journal is not None:
            self.journal.append(slot)

    def is_free(self, slot: int) -> bool:
        """Allocatable now (a quarantined slot is not)."""
        return self._state[slot] == _FREE

    def is_quarantined(self, slot: int) -> bool:
        return self._state[slot] == _QUARANTINED

    def free_slots(self) -> list[int]:
        return list(self._free)

    def quarantined_slots(self) -> list[int]:
        return list(self._quarantine)
