"""The worker's storage traffic over a real store in a directory: fetched bytes reach a slot only
while their fetch is live, every fetch is acknowledged once with the worker's rank, and nothing
per object is kept when storage is unbounded. Each runs with slots lent to the adapter (read in
place, the connector's pools) and with staged reads (a pool without header room or spares)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lmcache")

from himamba.connector.protocol import FetchItem, FetchOrder, ObjectKind  # noqa: E402
from himamba.connector.worker.worker_storage import WorkerStorage  # noqa: E402
from himamba.tiers.cpu_pool import HostSlotPool  # noqa: E402
from himamba.tiers.object_format import HEADER_SIZE  # noqa: E402
from tests.harness.stores import (
    make_store,  # noqa: E402
    store_reading_late,  # noqa: E402
)
from tests.unit.tiers.pool_helpers import read_slot, write_slot  # noqa: E402

KV, MAMBA = ObjectKind.KV, ObjectKind.MAMBA


def worker(
    tmp_path: Path,
    rank: int = 0,
    capacity: int | None = None,
    lend: bool = True,
    spares: int = 2,
    store=None,
) -> WorkerStorage:
    head, spare = (HEADER_SIZE, spares) if lend else (0, 0)
    pools = {
        KV: HostSlotPool([48, 16], 4, head_bytes=head, spares=spare),
        MAMBA: HostSlotPool([32], 2, head_bytes=head, spares=spare),
    }
    store = store or make_store(str(tmp_path))
    return WorkerStorage(store, pools, rank, capacity, "write_through")


def settle(ws: WorkerStorage, cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        ws.poll()
        time.sleep(0.01)
    assert cond()


def fill(ws: WorkerStorage, kind: int, slot: int, value: int) -> None:
    pool = ws.pools[kind]
    write_slot(pool, slot, torch.full((pool.slot_bytes,), value, dtype=torch.uint8))


@pytest.mark.parametrize("lend", [True, False], ids=["in_place", "staged"])
def test_written_slots_come_back_byte_exact_and_are_acknowledged_with_the_rank(tmp_path, lend):
    ws = worker(tmp_path, rank=1, lend=lend)
    fill(ws, KV, 0, 7)
    fill(ws, MAMBA, 1, 9)
    ws.on_stored(KV, [0], [b"h" * 32])
    ws.on_stored(MAMBA, [1], [b"h" * 32])
    settle(ws, lambda: ws.counters["storage_puts_ok"] == 2)
    items = [FetchItem(KV, b"h" * 32, 3), FetchItem(MAMBA, b"h" * 32, 0)]
    ws.fetch([FetchOrder(5, tuple(items))])
    settle(ws, lambda: not ws.outstanding())
    acks = ws.take_acks()
    assert [(a.fetch_id, a.rank, a.ok) for a in acks] == [(5, 1, (True, True))]
    assert bool((read_slot(ws.pools[KV], 3) == 7).all())
    assert bool((read_slot(ws.pools[MAMBA], 0) == 9).all())
    # Unbounded storage: no per-object bookkeeping grows with every write.
    assert ws.leak_report() == {
        "storage_gets_pending": 0,
        "storage_puts_pending": 0,
        "storage_acks_unsent": 0,
        "storage_lru_objects": 0,
        "storage_dirty_slots": 0,
        "storage_slots_lent": 0,
        "storage_slots_held": 0,
        "storage_released_early": 0,
    }
    ws.close()


@pytest.mark.parametrize("lend", [True, False], ids=["in_place", "staged"])
def test_a_cancelled_fetch_never_writes_its_slot_nor_acknowledges(tmp_path, lend):
    # The adapter is still reading when the fetch is given up: its late bytes must not land.
    ws = worker(tmp_path, lend=lend, store=store_reading_late(tmp_path, 0.3))
    fill(ws, KV, 0, 3)
    ws.on_stored(KV, [0], [b"k" * 32])
    settle(ws, lambda: ws.counters["storage_puts_ok"] == 1)
    fill(ws, KV, 2, 0)
    spares = ws.pools[KV].spares_free
    ws.fetch([FetchOrder(8, tuple([FetchItem(KV, b"k" * 32, 2)]))])
    time.sleep(0.05)
    ws.cancel([8])  # the scheduler reused slot 2 in the same plan
    fill(ws, KV, 2, 42)  # ... e.g. for a store of another block
    if lend:  # slot 2 lives on a spare now; its old memory is the adapter's until it answers
        assert ws.pools[KV].spares_free == spares - 1
    time.sleep(0.8)
    ws.poll()
    assert ws.take_acks() == []
    assert bool((read_slot(ws.pools[KV], 2) == 42).all())
    assert ws.counters["storage_gets_cancelled"] == 1 and not ws.outstanding()
    assert ws.pools[KV].spares_free == spares  # released and taken back
    ws.close()


def test_only_as_many_slots_are_lent_as_there_are_spares(tmp_path):
    """A fetch larger than the spares lends what they cover and stages the rest: a give-up
    can always move every lent slot onto a spare. Every byte still comes back exact."""
    ws = worker(tmp_path, spares=1, store=store_reading_late(tmp_path, 0.3))
    for slot in range(3):
        fill(ws, KV, slot, 10 + slot)
    ws.on_stored(KV, [0, 1, 2], [bytes([i]) * 32 for i in range(3)])
    settle(ws, lambda: ws.counters["storage_puts_ok"] == 3)
    for slot in range(3):
        fill(ws, KV, slot, 0)
    items = [FetchItem(KV, bytes([i]) * 32, i) for i in range(3)]
    ws.fetch([FetchOrder(1, tuple(items))])
    settle(ws, lambda: not ws.outstanding())
    assert [a.ok for a in ws.take_acks()] == [(True, True, True)]
    assert all(bool((read_slot(ws.pools[KV], s) == 10 + s).all()) for s in range(3))
    ws.fetch([FetchOrder(2, tuple(items))])
    time.sleep(0.05)
    ws.cancel([2])  # one lent slot moves onto the one spare; the staged ones need none
    assert ws.pools[KV].spares_free == 0
    settle(ws, lambda: ws.pools[KV].spares_free == 1)
    ws.close()


def test_capacity_evicts_the_oldest_objects_this_worker_wrote(tmp_path):
    ws = worker(tmp_path, capacity=2 * (64 + 64))  # room for two KV objects (header + payload)
    for i in range(3):
        fill(ws, KV, i, i + 1)
        ws.on_stored(KV, [i], [bytes([i]) * 32])
    settle(ws, lambda: ws.counters["storage_puts_ok"] == 3)
    assert ws.counters["storage_evictions"] == 1
    assert ws.leak_report()["storage_lru_objects"] == 2
    ws.close()


class ReleaseBeforeResult:
    """The real store, but a held get's result shows one poll late: its release (which the
    store announces once the adapter answered) then reaches the worker before the result, as
    when the result finishes just after a poll's snapshot."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self._late: list = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def poll(self) -> list:
        shown, self._late = self._late, []
        for r in self.inner.poll():
            (self._late if r.held else shown).append(r)
        return shown


def test_a_release_seen_before_its_held_result_leaves_no_slot_on_a_spare(tmp_path):
    # The adapter answers 0.4 s late; the store gives the get up after 0.1 s (held).
    inner = store_reading_late(tmp_path, 0.4, op_deadline_s=0.1)
    ws = worker(tmp_path, store=ReleaseBeforeResult(inner))
    fill(ws, KV, 0, 5)
    ws.on_stored(KV, [0], [b"r" * 32])
    settle(ws, lambda: ws.counters["storage_puts_ok"] == 1)
    spares = ws.pools[KV].spares_free
    ws.fetch([FetchOrder(3, (FetchItem(KV, b"r" * 32, 1),))])
    settle(ws, lambda: not ws.outstanding(), timeout=5.0)
    time.sleep(0.6)  # the adapter answered; its release and the result arrive out of order
    for _ in range(5):
        ws.poll()
        time.sleep(0.05)
    assert ws.pools[KV].spares_free == spares, "a slot stayed swapped onto a spare"
    assert ws.leak_report()["storage_released_early"] == 0
    ws.close()


def test_write_back_never_writes_a_slot_the_scheduler_freed(tmp_path):
    """A dirty slot freed without a write-back (replaced state, cascade, reset) and then handed
    to a fetch that failed must not be sealed under its old key at shutdown."""
    store = make_store(str(tmp_path))
    pools = {
        KV: HostSlotPool([48, 16], 4, head_bytes=HEADER_SIZE, spares=2),
        MAMBA: HostSlotPool([32], 2, head_bytes=HEADER_SIZE, spares=2),
    }
    ws = WorkerStorage(store, pools, 0, None, "write_back")
    fill(ws, KV, 2, 7)
    ws.on_stored(KV, [2], [b"d" * 32])
    assert ws.leak_report()["storage_dirty_slots"] == 1
    ws.forget_slots(KV, [2])  # the scheduler's plan: slot 2 was freed
    fill(ws, KV, 2, 99)  # ... reused, e.g. by a fetch that failed after writing into it
    ws.close()
    reader = worker(tmp_path)
    reader.fetch([FetchOrder(1, (FetchItem(KV, b"d" * 32, 0),))])
    settle(reader, lambda: not reader.outstanding())
    assert [a.ok for a in reader.take_acks()] == [(False,)]
    reader.close()


def test_a_writes_copy_into_store_memory_runs_on_the_copy_thread_not_the_callers(tmp_path):
    """Write-through's copy of a host slot into the store's write buffer runs on the copy
    thread (overlapping the next forward), in FIFO order with the copies before it."""
    import threading

    from himamba.connector.observability.metrics import StatsRecorder
    from himamba.connector.worker.copy_jobs import CopyJobs
    from himamba.connector.worker.counters import CopyCounters
    from himamba.tiers.transfer_engine import HostCopyEngine

    copies = CopyJobs(HostCopyEngine(), CopyCounters(), StatsRecorder())
    ws = worker(tmp_path)
    ws.stage_later = copies.submit_call
    gate = threading.Event()
    copies.submit_call(gate.wait)  # the copy thread is busy with an earlier copy
    fill(ws, KV, 0, 11)
    started = time.monotonic()
    ws.on_stored(KV, [0], [b"w" * 32])
    assert time.monotonic() - started < 0.5  # the caller did not copy (nor wait)
    time.sleep(0.2)
    ws.poll()
    assert ws.counters["storage_puts_ok"] == 0  # queued behind the busy copy thread
    gate.set()
    copies.wait_calls()
    settle(ws, lambda: ws.counters["storage_puts_ok"] == 1)
    ws.fetch([FetchOrder(1, (FetchItem(KV, b"w" * 32, 2),))])
    settle(ws, lambda: not ws.outstanding())
    assert bool((read_slot(ws.pools[KV], 2) == 11).all())
    ws.close()
    copies.close()


def test_an_idle_steps_wait_ends_with_the_fetch_and_its_ack_comes_once(tmp_path):
    """An engine step with nothing to do but wait for a fetch blocks for it instead of
    spinning: the wait ends when the bytes are in (not at its timeout), and the result it
    took is acknowledged by the next poll, exactly once."""
    ws = worker(tmp_path, store=store_reading_late(tmp_path, 0.3))
    fill(ws, KV, 0, 5)
    ws.on_stored(KV, [0], [b"w" * 32])
    settle(ws, lambda: ws.counters["storage_puts_ok"] == 1)
    fill(ws, KV, 1, 0)
    ws.fetch([FetchOrder(3, (FetchItem(KV, b"w" * 32, 1),))])
    t0 = time.monotonic()
    ws.wait_for_fetch(0.02)  # the adapter starts reading only after 0.3 s
    assert time.monotonic() - t0 < 0.25 and ws.outstanding()
    t0 = time.monotonic()
    ws.wait_for_fetch(30.0)
    assert time.monotonic() - t0 < 10.0  # returned with the result, long before the timeout
    ws.poll()
    assert [(a.fetch_id, a.ok) for a in ws.take_acks()] == [(3, (True,))]
    assert bool((read_slot(ws.pools[KV], 1) == 5).all()) and not ws.outstanding()
    ws.wait_for_fetch(0.01)  # nothing outstanding: returns at once, takes nothing
    ws.poll()
    assert ws.take_acks() == []
    ws.close()
