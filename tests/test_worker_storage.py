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

from test_storage_in_place import store_reading_late  # noqa: E402
from test_storage_tier import make_store  # noqa: E402

from himamba.connector.fetch_protocol import FetchItem, FetchOrder  # noqa: E402
from himamba.connector.worker.worker_storage import WorkerStorage  # noqa: E402
from himamba.tiers.cpu_pool import HostSlotPool  # noqa: E402
from himamba.tiers.object_format import HEADER_SIZE  # noqa: E402

KV, MAMBA = 0, 1


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
    ws.pools[kind].write_slot(
        slot, torch.full((ws.pools[kind].slot_bytes,), value, dtype=torch.uint8)
    )


@pytest.mark.parametrize("lend", [True, False], ids=["in_place", "staged"])
def test_written_slots_come_back_byte_exact_and_are_acknowledged_with_the_rank(tmp_path, lend):
    ws = worker(tmp_path, rank=1, lend=lend)
    fill(ws, KV, 0, 7)
    fill(ws, MAMBA, 1, 9)
    ws.on_stored(KV, [0], [b"h" * 32])
    ws.on_stored(MAMBA, [1], [b"h" * 32])
    settle(ws, lambda: ws.counters["storage_puts_ok"] == 2)
    items = [FetchItem(KV, b"h" * 32, 3), FetchItem(MAMBA, b"h" * 32, 0)]
    ws.fetch([FetchOrder(5, items)])
    settle(ws, lambda: not ws.outstanding())
    acks = ws.take_acks()
    assert [(a.fetch_id, a.rank, a.ok) for a in acks] == [(5, 1, (True, True))]
    assert bool((ws.pools[KV].read_slot(3) == 7).all())
    assert bool((ws.pools[MAMBA].read_slot(0) == 9).all())
    # Unbounded storage: no per-object bookkeeping grows with every write.
    assert ws.leak_report() == {
        "storage_gets_pending": 0,
        "storage_puts_pending": 0,
        "storage_acks_unsent": 0,
        "storage_lru_objects": 0,
        "storage_dirty_slots": 0,
        "storage_slots_lent": 0,
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
    ws.fetch([FetchOrder(8, [FetchItem(KV, b"k" * 32, 2)])])
    time.sleep(0.05)
    ws.cancel([8])  # the scheduler reused slot 2 in the same plan
    fill(ws, KV, 2, 42)  # ... e.g. for a store of another block
    if lend:  # slot 2 lives on a spare now; its old memory is the adapter's until it answers
        assert ws.pools[KV].spares_free == spares - 1
    time.sleep(0.8)
    ws.poll()
    assert ws.take_acks() == []
    assert bool((ws.pools[KV].read_slot(2) == 42).all())
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
    ws.fetch([FetchOrder(1, items)])
    settle(ws, lambda: not ws.outstanding())
    assert [a.ok for a in ws.take_acks()] == [(True, True, True)]
    assert all(bool((ws.pools[KV].read_slot(s) == 10 + s).all()) for s in range(3))
    ws.fetch([FetchOrder(2, items)])
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
