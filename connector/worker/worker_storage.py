"""Worker-side storage traffic: writes of host slots (by write policy), fetch orders into slots.

Runs inside vLLM's worker step, so nothing here blocks on storage: it submits to the store and
drains completions once per step. A fetch lends its host slots to the store (`ObjectView`): the
adapter reads each object straight into its slot, header room included, and the store checks
it there, so a fetched byte is copied once, by the adapter. A slot counts as fetched
only once its bytes validated. When a fetch ends while the adapter may still write into its
slots (a deadline, a cancel: the scheduler may hand the slots to someone else in the same plan,
see scheduler.fetch_ledger), the slots move onto spare memory (`HostSlotPool.swap_out`) and the old
memory comes back when the store releases it. Only as many slots are lent at once as there
are spares; the rest are fetched through the store's staging buffers. Each finished
fetch is acknowledged once, with this worker's rank.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from himamba.connector.observability.metrics import StatsRecorder
from himamba.connector.protocol import (
    FetchAck,
    FetchOrder,
    ObjectKind,
    StorageOp,
    StorageOutcome,
    StorageWrite,
    key_salt,
    salt_epoch,
)
from himamba.connector.worker.counters import StorageTrafficCounters
from himamba.tiers.byte_store import ByteStore
from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.object_format import HEADER_SIZE, StorageKey, stored_size
from himamba.tiers.staging import ObjectView
from himamba.tiers.storage_config import WritePolicy
from himamba.tiers.storage_records import TaskError, TaskResult

logger = logging.getLogger(__name__)

_SERIES = {ObjectKind.KV: "storage,kv", ObjectKind.MAMBA: "storage,mamba"}


@dataclass
class _Get:
    order: FetchOrder
    # Per item: its slot is lent to the store (an ObjectView), else the store copies validated
    # bytes into it from staging, only while the get is live.
    lent: list[bool]


class WorkerStorage:
    def __init__(
        self,
        store: ByteStore,
        pools: dict[int, HostSlotPool],
        rank: int,
        capacity_bytes: int | None,
        write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
    ) -> None:
        self.store = store
        self.pools = pools  # kind -> pool
        self.rank = rank
        self.capacity_bytes = capacity_bytes
        self.write_policy = WritePolicy(write_policy)
        # write_back: host slots whose content storage does not have yet, (kind, slot) ->
        # (hash, key salt). Flushed at a clean shutdown; cleared when the slot is written or
        # overwritten by a fetch (its content then belongs to another key).
        self._dirty: dict[tuple[int, int], tuple[bytes, str]] = {}
        self._gets: dict[int, _Get] = {}  # store task id -> live fetch
        self._lent = dict.fromkeys(pools, 0)  # kind -> slots lent to live gets
        self._held: dict[int, list[tuple[int, int]]] = {}  # task -> (kind, physical) held
        # Gets the store released before their result was polled: nothing to swap out then.
        self._released_early: set[int] = set()
        self._fetch_tasks: dict[int, int] = {}  # fetch id -> store task id
        self._puts: dict[int, list[StorageKey]] = {}
        # Objects this process wrote, oldest first: the LRU that capacity_gb evicts from. Kept
        # only when a capacity is set; unbounded storage needs no per-object record here.
        self._lru: OrderedDict[StorageKey, int] | None = (
            OrderedDict() if capacity_bytes is not None else None
        )
        self._lru_bytes = 0
        self._acks: list[FetchAck] = []
        # Results ``wait_for_fetch`` took from the store, for the next ``poll``.
        self._waited: list[TaskResult] = []
        self.counters = StorageTrafficCounters()
        # Metrics: per-op histograms and per-kind counts; submit time of each live store task.
        self.recorder = StatsRecorder()
        self._started: dict[int, float] = {}
        # Where a put's copy into store memory runs (WorkerHalf: the CPU copy thread, so it
        # overlaps the forward); None: at submission, on this thread.
        self.stage_later: Callable[[Callable[[], None]], None] | None = None
        # KV events (connector.kv_events): a list while vLLM publishes them, else None.
        self.outcomes: list[StorageOutcome] | None = None

    # -- writes ----------------------------------------------------------------------
    def on_stored(
        self,
        kind: int,
        slots: Sequence[int],
        hashes: Sequence[bytes],
        epoch: str = "",
        lora_tags: Sequence[str] = (),
    ) -> None:
        """Slots just filled from vLLM's cache: written now (write_through), remembered as
        dirty (write_back), or left to the scheduler's explicit writes (selective)."""
        salts = [key_salt(epoch, t) for t in lora_tags] if lora_tags else [epoch] * len(slots)
        if self.write_policy.writes_every_store:
            self._put(kind, slots, hashes, salts)
        elif self.write_policy.writes_evictions:
            for slot, h, salt in zip(slots, hashes, salts, strict=True):
                self._dirty[(kind, slot)] = (h, salt)

    def write_slots(self, items: Sequence[StorageWrite], epoch: str = "") -> None:
        """The scheduler's explicit writes: popular objects (selective) or objects the CPU tier
        is evicting (write-back), before their slots are reused."""
        for kind in {w.kind for w in items}:
            mine = [w for w in items if w.kind == kind]
            salts = [key_salt(epoch, w.lora_tag) for w in mine]
            self._put(kind, [w.slot for w in mine], [w.block_hash for w in mine], salts)

    def forget_slots(self, kind: ObjectKind, slots: Sequence[int]) -> None:
        """The scheduler freed these slots: whatever they hold belongs to no key any more, so
        write-back must never write them under the key they had."""
        if self._dirty:
            for slot in slots:
                self._dirty.pop((kind, slot), None)

    def _put(
        self, kind: int, slots: Sequence[int], hashes: Sequence[bytes], salts: Sequence[str]
    ) -> None:
        if not slots:
            return
        pool = self.pools[kind]
        keys = [StorageKey(h, ObjectKind(kind), s) for h, s in zip(hashes, salts, strict=True)]
        for slot in slots:
            self._dirty.pop((kind, slot), None)
        # The store copies each slot's layer rows into its own staging buffer before returning,
        # so the slot may be overwritten by a later step at once.
        payloads = [pool.slot_payload(s) for s in slots]
        if self.stage_later is None:
            tid = self.store.submit_put(keys, payloads)
        else:
            tid, stage = self.store.submit_put_later(keys, payloads)
            if stage is not None:
                self.stage_later(stage)
        self._puts[tid] = keys
        self._started[tid] = time.monotonic()

    def flush_dirty(self) -> int:
        """write_back at a clean shutdown: everything only the host had goes to storage."""
        by_kind: dict[int, list[tuple[int, bytes, str]]] = {}
        for (kind, slot), (h, salt) in self._dirty.items():
            by_kind.setdefault(kind, []).append((slot, h, salt))
        n = len(self._dirty)
        for kind, items in by_kind.items():
            self._put(
                kind, [s for s, _, _ in items], [h for _, h, _ in items], [x for *_, x in items]
            )
        return n

    # -- fetches -----------------------------------------------------------------------
    def cancel(self, fetch_ids: Iterable[int]) -> None:
        """Drop fetches the scheduler gave up: their bytes must never reach a slot now."""
        for fid in fetch_ids:
            tid = self._fetch_tasks.pop(fid, None)
            get = None if tid is None else self._gets.pop(tid, None)
            if get is not None:
                # Before the scheduler's reuse of its slots, this step.
                self._released_early.discard(tid)
                self._end_lending(tid, get, self.store.cancel(tid))
                self.counters.storage_gets_cancelled += 1

    def fetch(self, orders: Sequence[FetchOrder]) -> None:
        for order in orders:
            salt = key_salt(order.generation.epoch, order.lora_tag)
            keys = [StorageKey(it.block_hash, it.kind, salt) for it in order.items]
            dsts: list[Any] = []
            lent: list[bool] = []
            for it in order.items:
                pool = self.pools[it.kind]
                lend = pool.head_bytes == HEADER_SIZE and pool.spares_free > self._lent[it.kind]
                self._lent[it.kind] += lend
                dsts.append(
                    ObjectView(pool.slot_object(it.slot)) if lend else pool.slot_payload(it.slot)
                )
                lent.append(lend)
            tid = self.store.submit_get(keys, dsts)
            self._gets[tid] = _Get(order, lent)
            self._started[tid] = time.monotonic()
            self._fetch_tasks[order.fetch_id] = tid

    def _end_lending(self, tid: int, get: _Get, held: bool) -> None:
        """A get is over: its lent slots are back, or (`held`: the adapter may still write
        into them) move onto spares until the store releases the old memory."""
        for it, lent in zip(get.order.items, get.lent, strict=True):
            if lent:
                self._lent[it.kind] -= 1
                if held:
                    old = self.pools[it.kind].swap_out(it.slot)
                    self._held.setdefault(tid, []).append((it.kind, old))

    def _take_released(self) -> None:
        for tid in self.store.take_released():
            held = self._held.pop(tid, None)
            if held is not None:
                for kind, physical in held:
                    self.pools[kind].take_back(physical)
            elif tid in self._gets:
                # Its result (held) finished after this step's poll: it comes next poll.
                self._released_early.add(tid)

    def abort_fetches(self) -> list[FetchAck]:
        """Give up every running fetch (storage is being detached): each is acknowledged as
        failed now, and its late bytes are dropped like a cancelled fetch's."""
        acks = [
            _ack(get.order, self.rank, (False,) * len(get.order.items))
            for get in self._gets.values()
        ]
        for tid, get in self._gets.items():
            self._end_lending(tid, get, self.store.cancel(tid) and tid not in self._released_early)
        self._gets.clear()
        self._released_early.clear()
        self._fetch_tasks.clear()
        return acks

    def outstanding(self) -> bool:
        return bool(self._gets)

    def wait_for_fetch(self, timeout_s: float) -> None:
        """Block until the oldest live fetch's result is in, at most ``timeout_s`` (the
        caller's step has nothing else to do); the next ``poll`` handles what came."""
        if self._gets:
            res = self.store.wait(next(iter(self._gets)), timeout_s)
            if res is not None:
                self._waited.append(res)

    def poll(self) -> None:
        results = self.store.poll()
        if self._waited:
            results, self._waited = [*self._waited, *results], []
        for res in results:
            started = self._started.pop(res.task_id, None)
            get = self._gets.pop(res.task_id, None)
            if get is not None:
                self._fetch_tasks.pop(get.order.fetch_id, None)
                early = res.task_id in self._released_early
                self._released_early.discard(res.task_id)
                self._end_lending(res.task_id, get, res.held and not early)
                before = self.counters["storage_bytes_read"]
                self._finish_get(get, res)
                moved = self.counters["storage_bytes_read"] - before
                self._observe("fetch", started, res, moved)
                continue
            keys = self._puts.pop(res.task_id, None)
            if keys is not None:
                before = self.counters["storage_bytes_written"]
                self._finish_put(keys, res)
                moved = self.counters["storage_bytes_written"] - before
                self._observe("write", started, res, moved)
            # Anything else is a task of a cancelled fetch: its buffers are simply dropped.
        self._take_released()  # after the results: a task is reported before its release

    def _observe(self, op: str, started: float | None, res: TaskResult, nbytes: float) -> None:
        # The store's own completion time when it stamps one (monotonic); else now, which for a
        # write finished while the engine idled includes the idle time until the next step.
        if started is not None:
            done = getattr(res, "finished_at", 0.0) or time.monotonic()
            self.recorder.observe("storage_op_seconds", max(done - started, 0.0), op)
        if nbytes:
            self.recorder.observe("storage_op_bytes", nbytes, op)

    def _outcome(self, op: StorageOp, key: StorageKey) -> None:
        assert self.outcomes is not None  # the key's third field carries the epoch (see _put)
        epoch = salt_epoch(key.cache_salt)
        outcome = StorageOutcome(op, self.rank, int(key.kind), key.block_hash, epoch)
        self.outcomes.append(outcome)

    def _finish_get(self, get: _Get, res: TaskResult) -> None:
        oks: list[bool] = []
        for i, item in enumerate(get.order.items):
            ok = res.error is None and i < len(res.ok) and bool(res.ok[i])
            if ok:  # the store already wrote the slot
                self._dirty.pop((item.kind, item.slot), None)
                self.counters.storage_gets_ok += 1
                self.counters.storage_gets_in_place += get.lent[i]
                self.counters.storage_bytes_read += self.pools[item.kind].slot_bytes
            else:
                self.counters.storage_gets_failed += 1
                if self.outcomes is not None and res.error is None:  # missing or invalid here
                    gone = (StorageOp.REMOVED, self.rank, int(item.kind), item.block_hash)
                    self.outcomes.append(StorageOutcome(*gone, get.order.generation.epoch))
            oks.append(ok)
        self._acks.append(_ack(get.order, self.rank, tuple(oks)))

    def take_acks(self) -> list[FetchAck]:
        acks, self._acks = self._acks, []
        return acks

    # -- puts and capacity ---------------------------------------------------------------
    def _finish_put(self, keys: list[StorageKey], res: TaskResult) -> None:
        for i, key in enumerate(keys):
            ok = res.error is None and i < len(res.ok) and res.ok[i]
            if not ok:
                skipped = res.error is TaskError.BACKPRESSURE
                kind = "storage_puts_skipped" if skipped else "storage_puts_failed"
                self.counters[kind] += 1
                if self.outcomes is not None:
                    self._outcome(StorageOp.WRITE_FAILED, key)
                continue
            size = stored_size(self.pools[int(key.kind)].slot_bytes)
            self.counters.storage_puts_ok += 1
            self.counters.storage_bytes_written += size
            self.recorder.add("stores", 1, _SERIES[int(key.kind)])
            if self.outcomes is not None:
                self._outcome(StorageOp.WRITTEN, key)
            if self._lru is not None:
                if key not in self._lru:
                    self._lru[key] = size
                    self._lru_bytes += size
                self._lru.move_to_end(key)
        self._evict_over_capacity()

    def _evict_over_capacity(self) -> None:
        if self._lru is None or self.capacity_bytes is None:
            return
        victims = []
        while self._lru and self._lru_bytes > self.capacity_bytes:
            key, size = self._lru.popitem(last=False)
            self._lru_bytes -= size
            victims.append(key)
        if victims:
            self.store.submit_delete(victims)
            self.counters.storage_evictions += len(victims)
            for key in victims:
                self.recorder.add("evictions", 1, _SERIES[int(key.kind)])
                if self.outcomes is not None:
                    self._outcome(StorageOp.REMOVED, key)

    # -- lifecycle -----------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Wait (bounded) for submitted puts and gets, e.g. before a graceful shutdown."""
        deadline = time.monotonic() + timeout_s
        while (self._puts or self._gets) and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.005)
        return not (self._puts or self._gets)

    def leak_report(self) -> dict[str, int]:
        return {
            "storage_gets_pending": len(self._gets),
            "storage_puts_pending": len(self._puts),
            "storage_acks_unsent": len(self._acks),
            "storage_lru_objects": 0 if self._lru is None else len(self._lru),
            "storage_dirty_slots": len(self._dirty),
            "storage_slots_lent": sum(self._lent.values()),
            "storage_slots_held": sum(len(v) for v in self._held.values()),
            "storage_released_early": len(self._released_early),
        }

    def close(self, flush_timeout_s: float = 5.0) -> None:
        self.stage_later = None  # the copy thread may be gone: what is left copies here
        # Let writes land first (and, under write_back, write what only the host holds): a
        # graceful restart should find what this instance computed.
        if self._dirty:
            logger.info("himamba: write-back of %d host objects at shutdown", self.flush_dirty())
        self.flush(flush_timeout_s)
        self.store.close()
        self._take_released()  # the adapter is closed: what it held is free


def _ack(order: FetchOrder, rank: int, ok: tuple[bool, ...]) -> FetchAck:
    return FetchAck(order.fetch_id, order.generation.planner, rank, ok)
