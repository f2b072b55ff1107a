"""The scheduler's storage planner as a sequence of hook calls, over a real tree and a scripted
store (the store's answers are the input here, so a fake one is the point): a shard missing on
one rank is not fetched forever, a deadline passed in slow engine steps is not blamed on
storage, and a fetch never reads what vLLM's device cache already holds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from himamba.connector.protocol import FetchAck, ObjectKind
from himamba.connector.scheduler.counters import SchedulerCounters
from himamba.connector.scheduler.generations import StorageGenerations
from himamba.connector.scheduler.storage_planner import StoragePlanner
from himamba.connector.tree import HybridRadixTree
from himamba.connector.tree.invariants import check_invariants
from himamba.tiers.storage_config import StorageConfig

NUM_BLOCKS = 4


@dataclass
class Answer:
    task_id: int
    ok: tuple[bool, ...]
    error: object = None


@dataclass
class ScriptedStore:
    """Answers every ``exists`` with "all there" (or never, when ``silent``; or, given
    ``present``, with which of its (kind, hash) pairs are there)."""

    silent: bool = False
    present: set[tuple[ObjectKind, bytes]] | None = None
    slow_reports: list[str] = field(default_factory=list)
    probes: list[list] = field(default_factory=list)
    _next: int = 1
    _done: list[Answer] = field(default_factory=list)

    def submit_exists(self, keys: list) -> int:
        tid, self._next = self._next, self._next + 1
        self.probes.append(list(keys))
        if self.present is not None:
            ok = tuple((k.kind, k.block_hash) in self.present for k in keys)
            self._done.append(Answer(tid, ok))
        elif not self.silent:
            self._done.append(Answer(tid, (True,) * len(keys)))
        return tid

    def poll(self) -> list[Answer]:
        done, self._done = self._done, []
        return done

    def wait(self, task_id: int, timeout_s: float | None) -> Answer | None:
        for a in self._done:
            if a.task_id == task_id:
                self._done.remove(a)
                return a
        time.sleep(timeout_s or 0.0)  # as a real store blocks until its timeout
        return None

    def report_slow(self, reason: str) -> None:
        self.slow_reports.append(reason)

    def close(self) -> None:
        pass


def hashes(tag: int) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(NUM_BLOCKS)]


def planner(
    store: ScriptedStore, world_size: int = 1, block_size: int = 1, **storage: object
) -> StoragePlanner:
    cfg = StorageConfig.from_dict({"url": "file:///unused", **storage})
    tree = HybridRadixTree(32, 8)
    counters = SchedulerCounters()
    gens = StorageGenerations()
    return StoragePlanner(cfg, store, tree, counters, gens, world_size, block_size=block_size)


def ack_all(p: StoragePlanner, ranks_ok: dict[int, bool], first_item_only: bool = True) -> None:
    orders, _ = p.step()
    for order in orders:
        for rank, good in ranks_ok.items():
            ok = tuple(good or (first_item_only and i > 0) for i in range(len(order.items)))
            p.on_acks([FetchAck(order.fetch_id, order.generation.planner, rank, ok)])


def test_a_shard_missing_on_one_rank_is_not_fetched_again_until_it_is_rewritten() -> None:
    p = planner(ScriptedStore(), world_size=2)
    h = hashes(1)
    p.begin("a", h, None, 1000)
    assert p.must_wait("a", 0, NUM_BLOCKS)  # probe answered, fetch sent
    ack_all(p, {0: True, 1: False})  # rank 1 lacks block 0's shard
    assert p.counters["storage_fetch_failed"] == 1
    p.forget("a")
    # The next request with the same prefix: rank 0's probe still says yes.
    p.begin("b", h, None, 1000)
    assert not p.must_wait("b", 0, NUM_BLOCKS)  # nothing fetchable: no wait, no fetch
    assert p.step() == ([], [])
    assert p.counters["storage_missing_masked"] >= 1
    p.forget("b")
    # Written again (every rank): the next request may fetch it.
    p.wrote(ObjectKind.KV, h[0])
    p.begin("c", h, None, 1000)
    assert p.must_wait("c", 0, NUM_BLOCKS)
    orders, _ = p.step()
    assert orders and orders[0].items[0].block_hash == h[0]


def test_a_deadline_passed_in_slow_engine_steps_is_not_reported_as_slow_storage() -> None:
    store = ScriptedStore()
    p = planner(store, prefetch_timeout_base_s=0.05, prefetch_timeout_max_s=0.05)
    p.begin("a", hashes(2), None, 100)
    assert p.must_wait("a", 0, NUM_BLOCKS)  # answered at once; the fetch waits for acks
    time.sleep(0.08)  # a slow engine step: the workers' ack has not come back yet
    assert not p.must_wait("a", 0, NUM_BLOCKS)  # the request goes ahead ...
    assert store.slow_reports == []  # ... but storage answered in time: not its fault


def test_a_probe_the_store_never_answers_is_reported_as_slow() -> None:
    store = ScriptedStore(silent=True)
    p = planner(store, prefetch_timeout_base_s=0.05, prefetch_timeout_max_s=0.05, probe_wait_ms=1)
    p.begin("a", hashes(3), None, 100)
    assert p.must_wait("a", 0, NUM_BLOCKS)
    time.sleep(0.08)
    assert not p.must_wait("a", 0, NUM_BLOCKS)
    assert len(store.slow_reports) == 1


def test_a_fetch_starts_past_the_blocks_vllms_device_cache_holds() -> None:
    p = planner(ScriptedStore())
    h = hashes(4)
    p.begin("a", h, None, 1000)  # answered before the lookup: the fetch waits for it
    assert p.step() == ([], [])
    assert p.must_wait("a", 2, NUM_BLOCKS)  # vLLM holds blocks 0 and 1 on the device
    orders, _ = p.step()
    kv = [it.block_hash for it in orders[0].items if it.kind == ObjectKind.KV]
    assert kv == h[2:]


def test_a_best_effort_request_warms_the_host_from_block_zero_without_a_lookup() -> None:
    p = planner(ScriptedStore(), prefetch_policy="best_effort")
    h = hashes(5)
    p.begin("a", h, None, 1000)
    orders, _ = p.step()
    assert [it.block_hash for it in orders[0].items if it.kind == ObjectKind.KV] == h


def test_an_empty_step_waits_for_the_probe_in_flight_not_longer() -> None:
    """``idle_wait``: an engine step that scheduled nothing takes the probe's answer when it
    is there, and otherwise gives the CPU up for at most ``IDLE_PROBE_WAIT_S``; with nothing in
    flight it returns at once."""
    from himamba.connector.scheduler.storage_planner import IDLE_PROBE_WAIT_S, IDLE_WAIT_S

    store = ScriptedStore()
    p = planner(store)
    t = time.monotonic()
    p.idle_wait()  # nothing in flight
    assert time.monotonic() - t < IDLE_WAIT_S
    p.begin("a", hashes(1), None, NUM_BLOCKS * 16)
    p.idle_wait()  # the answer is there: taken
    assert not p.still_probing("a") and p.must_wait("a", 0, NUM_BLOCKS)  # answered, fetching
    silent = ScriptedStore(silent=True)
    q = planner(silent)
    q.begin("b", hashes(2), None, NUM_BLOCKS * 16)
    t = time.monotonic()
    q.idle_wait()  # no answer comes: the wait is bounded
    assert IDLE_PROBE_WAIT_S * 0.9 <= time.monotonic() - t < 0.5


def test_a_lookup_whose_probe_is_out_answers_ask_again_once_the_wait_budget_is_spent() -> None:
    """vLLM asks every waiting request each step; with many arrivals, most lookups are of
    requests whose probe is still out, and those answer before any other work."""
    silent = ScriptedStore(silent=True)
    p = planner(silent, probe_wait_ms=1)
    p.begin("a", hashes(1), None, NUM_BLOCKS * 16)
    assert not p.still_probing("a")  # this step's wait budget is not spent yet
    assert p.must_wait("a", 0, NUM_BLOCKS)  # spends it waiting for the probe
    assert p.still_probing("a")  # ... so the next lookup this step answers at once
    p.step()  # a new step: a new budget
    assert not p.still_probing("a")
    assert not p.still_probing("unknown")


def test_a_storage_hit_adding_less_than_the_threshold_is_not_fetched() -> None:
    """``prefetch_threshold_tokens``: 48 tokens = 3 blocks of 16. A request whose device hit
    leaves storage only 2 blocks to add takes what it has; one with 3 to gain is fetched.
    Nothing is left reserved or pinned by the one that was not."""
    p = planner(ScriptedStore(), block_size=16, prefetch_threshold_tokens=48)
    assert p.worth_probing(1, NUM_BLOCKS) and not p.worth_probing(2, NUM_BLOCKS)
    p.begin("a", hashes(6), None, 1000)
    assert not p.must_wait("a", 2, NUM_BLOCKS)  # vLLM's device holds 2 of 4: 2 to gain
    assert p.step() == ([], [])
    assert p.counters["storage_fetch_below_threshold"] == 1
    check_invariants(p.tree)
    st = p.tree.stats()
    assert (st["pending_stores"], st["host_kv_used"], st["pins"]) == (0, 0, 0)
    p.forget("a")
    p.begin("b", hashes(7), None, 1000)
    assert p.must_wait("b", 1, NUM_BLOCKS)  # 3 to gain: fetched
    orders, _ = p.step()
    assert [it.block_hash for it in orders[0].items if it.kind == ObjectKind.KV] == hashes(7)[1:]
    for order in orders:
        ok = (True,) * len(order.items)
        p.on_acks([FetchAck(order.fetch_id, order.generation.planner, 0, ok)])
    assert not p.must_wait("b", 1, NUM_BLOCKS)  # fetched: the request goes ahead
    p.forget("b")
    assert p.leak_report() == {
        "storage_requests": 0,
        "storage_probes_pending": 0,
        "storage_fetches_open": 0,
        "storage_fetch_slots_held": 0,
    }
    check_invariants(p.tree)


def test_a_prompt_storage_lacks_block_zero_of_costs_one_key_and_settles() -> None:
    """A storage hit starts with block 0's KV object. A probe asks for it alone first; without
    it the request settles at once (no hit, as the full probe would have said), and with it
    the rest of the probe goes out and the hit is as deep as the objects allow."""
    h = hashes(8)
    store = ScriptedStore(present={(ObjectKind.KV, x) for x in h[1:]} | {(ObjectKind.MAMBA, h[3])})
    p = planner(store)
    p.begin("a", h, None, 1000)
    assert not p.must_wait("a", 0, NUM_BLOCKS)  # blocks 1-3 alone are no hit: settled
    assert [(k.kind, k.block_hash) for k in store.probes[0]] == [(ObjectKind.KV, h[0])]
    assert len(store.probes) == 1 and p.counters["storage_probes_head_missed"] == 1
    assert p.tree.match(h, None, 0, NUM_BLOCKS).num_blocks == 0
    assert p.step() == ([], [])
    # Block 0 there too (states after blocks 2 and 4): the rest is probed, the deepest hit fetched.
    g = hashes(9)
    store.present = {(ObjectKind.KV, x) for x in g} | {
        (ObjectKind.MAMBA, g[1]),
        (ObjectKind.MAMBA, g[3]),
    }
    p.begin("b", g, None, 1000)
    assert p.must_wait("b", 0, NUM_BLOCKS)  # both rounds answered within the wait: fetching
    assert len(store.probes[-1]) == 2 * NUM_BLOCKS
    orders, _ = p.step()
    items = [(it.kind, it.block_hash) for it in orders[0].items]
    assert items == [(ObjectKind.KV, x) for x in g] + [(ObjectKind.MAMBA, g[3])]
    assert p.counters["storage_probes_head_missed"] == 1
    # A one-block prompt is probed whole at once (its head is its whole probe).
    p.begin("c", hashes(10)[:1], None, 1000)
    assert len(store.probes[-1]) == 2
