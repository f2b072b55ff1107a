"""The scheduler's record of storage -> host fetches until every TP rank acknowledged them.

A fetch reads stored objects into host slots the scheduler reserved. Every worker (TP rank)
reads its own shard, so a fetch is complete only when *every* rank acknowledged it; vLLM merges
worker metadata per step and keeps no count across steps, so acknowledgements are accumulated
here, per fetch id and rank, for as many steps as they take.

The scheduler alone decides when a reserved slot may be reused. It never waits for a worker to
agree: to give a fetch up (request aborted, reset, acknowledgements lost, storage detached) it
sends a *cancel* and frees the slots at once. That is safe because workers execute plans in
order and apply a plan's cancels before anything else in it, and a worker writes fetched bytes
into a slot only while the fetch is live. Fetch ids come from the scheduler's
``StorageGenerations`` and are never reused, and an acknowledgement names its planner, so a
late one can never complete another fetch that reuses the same slots.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from himamba.connector.protocol import FetchAck, FetchItem, FetchOrder, Generation
from himamba.connector.scheduler.counters import LedgerCounters
from himamba.connector.scheduler.generations import StorageGenerations


class FetchOutcome(enum.Enum):
    DONE = "done"  # every rank acknowledged; per-item results applied
    ABANDONED = "abandoned"  # cancelled before every rank acknowledged; all items rolled back


@dataclass
class _Open:
    order: FetchOrder
    expires: float
    acks: dict[int, tuple[bool, ...]] = field(default_factory=dict)
    batches: int = 0  # how many steps' worker outputs carried acknowledgements of it


# Called once per finished fetch: (order, per-item ok on every rank, outcome).
Settle = Callable[[FetchOrder, list[bool], FetchOutcome], None]


class FetchLedger:
    """Scheduler-side record of every fetch that is not settled yet."""

    def __init__(
        self, world_size: int, on_settle: Settle, generations: StorageGenerations, planner: int
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._on_settle = on_settle
        self._generations = generations
        self.planner = planner
        self._open: dict[int, _Open] = {}
        self._orders: list[FetchOrder] = []
        self._cancels: list[int] = []
        self.counters = LedgerCounters()

    def open(self, items: list[FetchItem], expires: float, lora_tag: str = "") -> int:
        """Record a new fetch and queue its order for the next plan; returns its id."""
        fid = self._generations.next_fetch_id()
        generation = Generation(self._generations.epoch, self.planner)
        order = FetchOrder(fid, tuple(items), generation, lora_tag)
        self._open[fid] = _Open(order, expires)
        self._orders.append(order)
        return fid

    def is_open(self, fetch_id: int) -> bool:
        return fetch_id in self._open

    def on_acks(self, acks: Iterable[FetchAck]) -> None:
        """One step's merged worker acknowledgements."""
        seen: set[int] = set()
        for ack in acks:
            entry = self._open.get(ack.fetch_id) if ack.planner == self.planner else None
            if entry is None:
                self.counters.stale_acks += 1  # cancelled or finished already: ignore
                continue
            if ack.rank in entry.acks or len(ack.ok) != len(entry.order.items):
                self.counters.duplicate_acks += 1
                continue
            entry.acks[ack.rank] = ack.ok
            if ack.fetch_id not in seen:
                seen.add(ack.fetch_id)
                entry.batches += 1
            if len(entry.acks) >= self.world_size:
                del self._open[ack.fetch_id]
                ok = [all(r[i] for r in entry.acks.values()) for i in range(len(ack.ok))]
                self.counters.fetches_done += 1
                self.counters.fetches_acked_across_steps += entry.batches > 1
                self._on_settle(entry.order, ok, FetchOutcome.DONE)

    def abandon(self, fetch_id: int) -> bool:
        """Give a fetch up now: its slots are rolled back and workers are told to drop it."""
        entry = self._open.pop(fetch_id, None)
        if entry is None:
            return False
        if entry.order in self._orders:
            self._orders.remove(entry.order)  # never sent: nothing to cancel
        else:
            self._cancels.append(fetch_id)
        self.counters.fetches_abandoned += 1
        self._on_settle(entry.order, [False] * len(entry.order.items), FetchOutcome.ABANDONED)
        return True

    def expire(self, now: float) -> list[int]:
        """Abandon fetches whose acknowledgements are overdue (lost, or a rank is gone)."""
        late = [fid for fid, e in self._open.items() if e.expires <= now]
        for fid in late:
            self.abandon(fid)
        return late

    def abandon_all(self) -> None:
        for fid in list(self._open):
            self.abandon(fid)

    def take_outbox(self) -> tuple[list[FetchOrder], list[int]]:
        """(orders, cancels) for the plan being built now."""
        orders, self._orders = self._orders, []
        cancels, self._cancels = self._cancels, []
        return orders, cancels

    def __len__(self) -> int:
        return len(self._open)

    def held_slots(self) -> int:
        return sum(len(e.order.items) for e in self._open.values())
