"""Storage -> host fetches the storage planner starts: reserved, ordered, settled in the tree.

The planner decides *whether* a request fetches (its phase, its deadline); this module owns
what a fetch is once decided. It reserves host slots for the storage-only part of the deepest
hit that fits, past what the device and host already hold, with the hit's path pinned so the
reservation cannot evict the prefix being fetched (``fetch_slots``). The order goes to every
rank through the ledger, which settles it once every rank acknowledged it (or it was given
up): each item's slot then completes in the tree, an item some rank could not read evicts what
storage was believed to hold from that block on and is remembered as missing, and the pin is
released. The planner learns the outcome through ``on_settled`` and never touches a fetch's
slots itself, so the two halves share no mutable state but the tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from himamba.connector.protocol import FetchAck, FetchOrder, ObjectKind
from himamba.connector.scheduler.counters import LedgerCounters, SchedulerCounters
from himamba.connector.scheduler.fetch_ledger import FetchLedger, FetchOutcome
from himamba.connector.scheduler.fetch_slots import Refused, reserve_fetch
from himamba.connector.scheduler.generations import StorageGenerations
from himamba.connector.scheduler.missing_objects import MissingObjects
from himamba.connector.tree import HybridRadixTree, LockHandle


@dataclass
class _Fetch:
    req_id: str
    # Cancel the fetch when this request finishes: it was fetched for the request's own wait.
    # Background fetches (best_effort, or a wait that timed out) warm the host for later ones.
    tied_to_request: bool
    pin: LockHandle  # over the fetched path
    hashes: Sequence[bytes]
    partition: Hashable
    # Block index each item belongs to (KV: its block; Mamba: the last block before its boundary).
    indexes: list[int]
    num_kv: int


@dataclass(frozen=True)
class Settled:
    """A fetch is over: what the request it was started for may count as fetched."""

    req_id: str
    fetch_id: int
    # Blocks whose KV every rank read (None: the fetch failed in part or was given up).
    fetched_blocks: frozenset[int] | None


class StorageFetches:
    """Every fetch not settled yet, and the tree work that starts and settles one."""

    def __init__(
        self,
        tree: HybridRadixTree,
        counters: SchedulerCounters,
        generations: StorageGenerations,
        planner_id: int,
        world_size: int,
        op_deadline_s: float,
        min_gain_blocks: int,
        missing: MissingObjects,
        on_settled: Callable[[Settled], None],
    ) -> None:
        self.tree = tree
        self.counters = counters
        self.min_gain_blocks = min_gain_blocks
        self._op_deadline_s = op_deadline_s
        self._missing = missing
        self._on_settled = on_settled
        self._ledger = FetchLedger(world_size, self._settle, generations, planner_id)
        self._open: dict[int, _Fetch] = {}

    def start(
        self,
        req_id: str,
        hashes: Sequence[bytes],
        partition: Hashable,
        start_block: int,
        tied_to_request: bool,
        lora_tag: str = "",
    ) -> int | None:
        """Reserve host slots for the storage-only part of the deepest hit past
        ``start_block`` that fits; returns the fetch id (None: nothing worth fetching)."""
        res = self.tree.match(hashes, partition, start_block, len(hashes))
        have = max(res.host_num_blocks, start_block)
        if res.num_blocks <= have:
            return None
        if res.num_blocks - have < self.min_gain_blocks:
            self.counters.storage_fetch_below_threshold += 1
            return None
        got = reserve_fetch(self.tree, hashes, partition, res, have, self.min_gain_blocks)
        if isinstance(got, Refused):
            self.counters[got.value] += 1
            return None
        if got.shortened:
            self.counters.storage_fetch_shortened += 1
        # Every storage op ends by its deadline after reaching the adapter, so acknowledgements
        # are due within a few deadlines; later, a rank died or an acknowledgement was lost, and
        # the fetch is given up (cancelled, its slots reclaimed).
        expires = time.monotonic() + 3 * self._op_deadline_s
        fid = self._ledger.open(got.items, expires, lora_tag)
        self._open[fid] = _Fetch(
            req_id, tied_to_request, got.pin, hashes, partition, got.indexes, got.num_kv
        )
        self.counters.storage_fetches += 1
        return fid

    def untie(self, fetch_id: int) -> None:
        """Its request stops waiting: the fetch goes on for later requests."""
        ctx = self._open.get(fetch_id)
        if ctx is not None:
            ctx.tied_to_request = False

    def drop_if_tied(self, fetch_id: int) -> None:
        """Its request finished: a fetch only it waited for is given up now."""
        ctx = self._open.get(fetch_id)
        if ctx is not None and ctx.tied_to_request:
            self._ledger.abandon(fetch_id)

    def step(self, now: float) -> tuple[list[FetchOrder], list[int]]:
        """Give up overdue fetches; (orders, cancels) for the plan being built."""
        self._ledger.expire(now)
        return self._ledger.take_outbox()

    def on_acks(self, acks: Sequence[FetchAck]) -> None:
        self._ledger.on_acks(acks)

    def abandon_all(self) -> None:
        self._ledger.abandon_all()

    def take_cancels(self) -> list[int]:
        """The fetch ids workers must still be told to cancel (after ``abandon_all``)."""
        return self._ledger.take_outbox()[1]

    def __len__(self) -> int:
        return len(self._ledger)

    def held_slots(self) -> int:
        return self._ledger.held_slots()

    @property
    def ledger_counters(self) -> LedgerCounters:
        return self._ledger.counters

    def _settle(self, order: FetchOrder, ok: list[bool], outcome: FetchOutcome) -> None:
        ctx = self._open.pop(order.fetch_id)
        for item, good, index in zip(order.items, ok, ctx.indexes, strict=True):
            if item.kind == ObjectKind.KV:
                self.tree.complete_store([item.slot], [], ok=good)
            else:
                self.tree.complete_store([], [item.slot], ok=good)
            if outcome is FetchOutcome.DONE:
                self.counters["storage_fetched" if good else "storage_fetch_failed"] += 1
                if not good:
                    # Storage said yes but the bytes were missing or invalid on some rank:
                    # forget them (and, conservatively, everything stored after them), and do
                    # not believe the next probe that says yes until they are written again.
                    self.tree.evict_storage(ctx.hashes, ctx.partition, index, None)
                    self._missing.remember(item.kind, item.block_hash, order.generation.epoch)
        self.tree.unlock(ctx.pin)
        if outcome is FetchOutcome.ABANDONED:
            self.counters.storage_fetches_abandoned += 1
        whole = outcome is FetchOutcome.DONE and all(ok)
        fetched = frozenset(ctx.indexes[: ctx.num_kv]) if whole else None
        self._on_settled(Settled(ctx.req_id, order.fetch_id, fetched))
