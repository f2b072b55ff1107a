"""Prometheus metrics per tier, through vLLM's own connector-stats path.

vLLM's real scheduler and connectors (both roles, TP workers merged by vLLM's
``KVOutputAggregator``) run a workload; every ``SchedulerStats`` the scheduler emits is sent
through vLLM's msgpack codec, as between engine core and API server, and fed to the metrics
``build_prom_metrics`` registers, in a private Prometheus registry. The tests read that registry
as a scrape would and compare it with what really happened in the connector.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from himamba.connector.observability.metrics import METRICS, PREFIX, HiMambaStats
from himamba.connector.protocol import ControlAction
from himamba.connector.vllm_connector import HiMambaConnector
from himamba.tiers.cpu_pool import split_slots
from tests.lifecycle.engine import LifecycleEngine
from tests.lifecycle.faults import StorageFaults, faulty_storage
from tests.lifecycle.vllm_setup import EngineSpec, make_model_config, write_model_dir
from tests.lifecycle.workload import prompt_of
from tests.unit.connector.control_engine import switch_storage

# 0.5 MiB CPU tier (as the lifecycle suite): 192 KV slots of 2 KiB, 292 Mamba slots.
CPU_CACHE_GB = 0.5 / 1024
LABELS = {"model_name": "tiny", "engine": "0"}


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model_dir = write_model_dir(tmp_path_factory.mktemp("metrics-model"))
    return make_model_config(model_dir, max_model_len=EngineSpec().max_model_len)


class Exported:
    """What /metrics would show for one engine: every payload the scheduler ships, encoded and
    decoded as vLLM's IPC does, rebuilt with ``build_kv_connector_stats`` and observed."""

    def __init__(self, engine: LifecycleEngine) -> None:
        self.registry = CollectorRegistry()
        types = {
            cls: functools.partial(cls, registry=self.registry)
            for cls in (Counter, Gauge, Histogram)
        }
        self.prom = HiMambaConnector.build_prom_metrics(
            engine.vllm_config, types, list(LABELS), {0: list(LABELS.values())}
        )
        self.payloads: list[dict[str, Any] | None] = []
        self._encoder, self._decoder = MsgpackEncoder(), MsgpackDecoder(SchedulerStats)
        absorb = engine._absorb

        def observe(stats: Any) -> None:
            stats = self._decoder.decode(self._encoder.encode(stats))
            self.payloads.append(stats.kv_connector_stats)
            if stats.kv_connector_stats is not None:
                rebuilt = HiMambaConnector.build_kv_connector_stats(stats.kv_connector_stats)
                assert isinstance(rebuilt, HiMambaStats) and not rebuilt.is_empty()
                self.prom.observe(rebuilt.data, 0)
            absorb(stats)

        engine._absorb = observe  # type: ignore[method-assign]

    def value(self, name: str, suffix: str = "", **labels: str) -> float:
        sample = f"{PREFIX}{name}{suffix}"
        v = self.registry.get_sample_value(sample, {**LABELS, **labels})
        assert v is not None, f"{sample}{labels} is not exported"
        return v

    def counter(self, name: str, **labels: str) -> float:
        return self.value(name, "_total", **labels)


@pytest.fixture
def make_engine(model_config: Any) -> Iterator[Callable[..., tuple[LifecycleEngine, Exported]]]:
    engines: list[LifecycleEngine] = []

    def build(**fields: Any) -> tuple[LifecycleEngine, Exported]:
        spec = dataclasses.replace(EngineSpec(), **fields)
        engine = LifecycleEngine(spec, model_config)
        engines.append(engine)
        return engine, Exported(engine)

    yield build
    for engine in engines:
        engine.close()


def serve(engine: LifecycleEngine, req_id: str, prompt: list[int], max_tokens: int = 3) -> None:
    engine.add_request(req_id, prompt, max_tokens=max_tokens)
    engine.run_until_idle()


def worker_counters(engine: LifecycleEngine, rank: int = 0) -> dict[str, float]:
    return engine.runners[rank].connector.stats()


def test_every_metric_series_is_exported_from_the_start(make_engine):
    _, exported = make_engine(connector_config={"cpu_cache_gb": CPU_CACHE_GB})
    for m in METRICS.values():
        for values in m.series:
            labels = dict(zip(m.labels, values, strict=True))
            suffix = {"counter": "_total", "histogram": "_count"}.get(m.kind.value, "")
            assert exported.value(m.name, suffix, **labels) == 0, (m.name, labels)


def test_cpu_tier_hit_is_exported_with_occupancy_stores_and_copy_histograms(make_engine):
    engine, exported = make_engine(connector_config={"cpu_cache_gb": CPU_CACHE_GB})
    prompt = prompt_of(1, 80)
    serve(engine, "a", prompt)
    assert engine.scheduler.reset_prefix_cache()  # only the CPU tier has the prefix now
    serve(engine, "b", prompt)

    sched = engine.connector.scheduler
    layout, tree = sched.layout, sched.tree
    assert engine.hits.host == 64  # vLLM's own per-source count agrees with ours
    assert exported.counter("hit_tokens", tier="cpu") == 64
    assert exported.counter("hit_tokens", tier="storage") == 0
    assert exported.counter("stores", tier="cpu", object="kv") == sched.counters["kv_blocks_stored"]
    assert (
        exported.counter("stores", tier="cpu", object="mamba")
        == sched.counters["mamba_states_stored"]
    )
    assert sched.counters["kv_blocks_stored"] >= 4
    assert exported.value("cpu_slots_used", object="kv") == tree.kv_slots.num_used > 0
    assert exported.value("cpu_slots_used", object="mamba") == tree.mamba_slots.num_used > 0
    # 192 slots fit the budget; the workers' spares (in-place storage reads) come out of it.
    kv_capacity = tree.kv_slots.capacity
    assert exported.value("cpu_slots_capacity", object="kv") == kv_capacity == split_slots(192)
    assert exported.value("cpu_slots_capacity", object="mamba") == tree.mamba_slots.capacity
    # One load: 4 KV blocks and the Mamba state at their end, CPU tier -> "GPU".
    assert exported.value("load_seconds", "_count") == 1
    assert (
        exported.value("load_bytes", "_sum") == 4 * layout.kv_slot_bytes + layout.mamba_slot_bytes
    )
    w = worker_counters(engine)
    assert exported.value("load_bytes", "_sum") == w["bytes_loaded"]
    assert exported.value("store_bytes", "_sum") == w["bytes_stored"] > 0
    assert exported.value("store_seconds", "_count") == exported.value("store_bytes", "_count")
    assert exported.counter("evictions", tier="cpu", object="kv") == 0
    assert exported.value("storage_breaker_state") == 0


def test_idle_steps_ship_no_payload(make_engine):
    engine, exported = make_engine(connector_config={"cpu_cache_gb": CPU_CACHE_GB})
    serve(engine, "a", prompt_of(2, 80))
    shipped = len(exported.payloads)
    engine.idle_steps(5)
    assert len(exported.payloads) == shipped + 5
    assert exported.payloads[-5:] == [None] * 5


def test_cpu_evictions_are_counted_and_occupancy_stays_within_capacity(make_engine):
    engine, exported = make_engine(connector_config={"cpu_cache_gb": 0.05 / 1024})  # 19 slots
    for i in range(8):
        serve(engine, f"r{i}", prompt_of(10 + i, 96))
    tree = engine.connector.scheduler.tree.counters
    evicted_kv = tree["kv_evicted"] + tree["kv_cascaded"]
    assert evicted_kv > 0
    assert exported.counter("evictions", tier="cpu", object="kv") == evicted_kv
    assert exported.counter("evictions", tier="cpu", object="mamba") == (
        tree["mamba_evicted"] + tree["mamba_cascaded"]
    )
    cap = exported.value("cpu_slots_capacity", object="kv")
    assert exported.value("cpu_slots_used", object="kv") == cap  # full, never over


def test_tp2_counts_occupancy_and_hits_once_and_copies_per_rank(make_engine):
    engine, exported = make_engine(
        tensor_parallel_size=2, connector_config={"cpu_cache_gb": CPU_CACHE_GB}
    )
    prompt = prompt_of(3, 80)
    serve(engine, "a", prompt)
    assert engine.scheduler.reset_prefix_cache()
    serve(engine, "b", prompt)
    tree = engine.connector.scheduler.tree
    assert exported.counter("hit_tokens", tier="cpu") == 64
    assert exported.value("cpu_slots_used", object="kv") == tree.kv_slots.num_used
    assert exported.value("load_seconds", "_count") == 2  # one copy per rank
    assert exported.value("load_bytes", "_sum") == sum(
        worker_counters(engine, r)["bytes_loaded"] for r in (0, 1)
    )


def test_storage_hit_and_storage_traffic_are_exported(make_engine, tmp_path: Path):
    cfg = {"cpu_cache_gb": CPU_CACHE_GB, "storage": {"url": f"file://{tmp_path}"}}
    prompt = prompt_of(4, 80)
    writer, written = make_engine(connector_config=cfg)
    serve(writer, "a", prompt)
    writer.runners[0].connector.worker.flush_storage(10)
    writer.idle_steps(2)  # the flushed writes' results reach the stats
    w = worker_counters(writer)
    assert w["storage_puts_ok"] > 0
    assert (
        written.counter("stores", tier="storage", object="kv")
        + written.counter("stores", tier="storage", object="mamba")
        == w["storage_puts_ok"]
    )
    assert written.value("storage_op_seconds", "_count", op="write") >= 1
    assert written.value("storage_op_bytes", "_sum", op="write") == w["storage_bytes_written"]
    writer.close()

    reader, read = make_engine(connector_config=cfg)
    serve(reader, "b", prompt)
    r = worker_counters(reader)
    assert reader.hits.storage == 64
    assert read.counter("hit_tokens", tier="storage") == 64
    assert read.counter("hit_tokens", tier="cpu") == 0
    # 4 KV blocks and one Mamba state came storage -> CPU tier, then CPU tier -> "GPU".
    assert read.counter("storage_fetches", outcome="ok") == 5
    assert read.value("storage_op_seconds", "_count", op="fetch") >= 1
    assert read.value("storage_op_bytes", "_sum", op="fetch") == r["storage_bytes_read"] > 0
    assert read.value("load_seconds", "_count") == 1
    assert sum(read.counter("storage_errors", kind=k) for k in ("timeout", "checksum")) == 0


def _corrupt_payloads(root: Path) -> int:
    """Flip the last byte of every stored object (payload, not header): checksums fail."""
    files = [f for f in root.rglob("*.data") if f.is_file()]
    for f in files:
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    return len(files)


def test_corrupted_objects_are_counted_as_checksum_errors(make_engine, tmp_path: Path):
    cfg = {"cpu_cache_gb": CPU_CACHE_GB, "storage": {"url": f"file://{tmp_path}"}}
    prompt = prompt_of(5, 80)
    writer, _ = make_engine(connector_config=cfg)
    serve(writer, "a", prompt)
    writer.close()
    assert _corrupt_payloads(tmp_path) > 0
    reader, read = make_engine(connector_config=cfg)
    serve(reader, "b", prompt)
    reader.runners[0].connector.worker.flush_storage(10)
    reader.idle_steps(2)
    assert reader.hits.storage == 0
    assert read.counter("storage_errors", kind="checksum") >= 1
    assert read.counter("storage_fetches", outcome="failed") >= 1
    assert read.counter("storage_errors", kind="timeout") == 0


def test_failed_writes_open_the_breaker_and_the_gauge_shows_it(make_engine, tmp_path: Path):
    storage = {"url": f"file://{tmp_path}", "breaker_failures": 2, "breaker_cooldown_s": 60.0}
    with faulty_storage(StorageFaults(fail_rate_store=1.0)):
        engine, exported = make_engine(
            connector_config={"cpu_cache_gb": CPU_CACHE_GB, "storage": storage}
        )
        for i in range(3):
            serve(engine, f"r{i}", prompt_of(20 + i, 80))
        engine.runners[0].connector.worker.flush_storage(10)
        engine.idle_steps(2)
    assert exported.counter("storage_errors", kind="backend") >= 2
    assert exported.counter("storage_breaker_opens") >= 1
    assert exported.value("storage_breaker_state") == 1  # open for the 60 s cool-down


def test_breaker_gauge_shows_the_attached_stores_state(make_engine, tmp_path: Path):
    broken = {"url": f"file://{tmp_path}", "breaker_failures": 2, "breaker_cooldown_s": 60.0}
    healthy = tmp_path / "healthy"
    healthy.mkdir()
    with faulty_storage(StorageFaults(fail_rate_store=1.0)):
        engine, exported = make_engine(
            connector_config={"cpu_cache_gb": CPU_CACHE_GB, "storage": broken}
        )
        for i in range(3):
            serve(engine, f"r{i}", prompt_of(30 + i, 80))
        engine.runners[0].connector.worker.flush_storage(10)
        engine.idle_steps(2)
    assert exported.value("storage_breaker_state") == 1
    # Another store attached at run time: the gauge shows its state, not the one it replaced.
    switch_storage(engine, ControlAction.ATTACH, {"url": f"file://{healthy}"})
    engine.idle_steps(2)
    assert exported.value("storage_breaker_state") == 0

    with faulty_storage(StorageFaults(fail_rate_store=1.0)):
        switch_storage(engine, ControlAction.ATTACH, {**broken, "url": f"file://{tmp_path}/b"})
        for i in range(3):
            serve(engine, f"s{i}", prompt_of(40 + i, 80))
        engine.runners[0].connector.worker.flush_storage(10)
        engine.idle_steps(2)
    assert exported.value("storage_breaker_state") == 1
    # Detached: no store is in any state; the gauge must not keep the last one's.
    switch_storage(engine, ControlAction.DETACH)
    engine.idle_steps(2)
    assert exported.value("storage_breaker_state") == 0


def test_slow_reads_are_counted_as_timeouts_and_missing_reads_as_missing(
    make_engine, tmp_path: Path
):
    storage = {"url": f"file://{tmp_path}", "op_deadline_s": 0.2, "breaker_failures": 100}
    cfg = {"cpu_cache_gb": CPU_CACHE_GB, "storage": storage}
    writer, _ = make_engine(connector_config=cfg)
    serve(writer, "a", prompt_of(6, 80))
    serve(writer, "b", prompt_of(7, 80))
    writer.close()
    faults = StorageFaults()
    faults.hold_loads.set()
    with faulty_storage(faults):
        reader, read = make_engine(connector_config=cfg)
        serve(reader, "a", prompt_of(6, 80))  # its fetch never answers: op deadline
        faults.release()
        faults.fail_rate_load = 1.0  # the adapter answers, but cannot load the objects
        serve(reader, "b", prompt_of(7, 80))
        reader.runners[0].connector.worker.flush_storage(10)
        reader.idle_steps(2)
    assert read.counter("storage_errors", kind="timeout") >= 1
    assert read.counter("storage_errors", kind="missing") >= 1
    assert read.counter("storage_errors", kind="checksum") == 0
    assert reader.hits.storage == 0


def test_stats_merge_sums_counters_keeps_worst_gauge_and_joins_histograms():
    a = HiMambaStats(
        data={
            "counter": {"hit_tokens": {"cpu": 16}},
            "gauge": {"storage_breaker_state": {"": 0}},
            "histogram": {"load_seconds": {"": [0.1]}},
        }
    )
    b = HiMambaStats(
        data={
            "counter": {"hit_tokens": {"cpu": 32, "storage": 16}},
            "gauge": {"storage_breaker_state": {"": 1}},
            "histogram": {"load_seconds": {"": [0.2, 0.3]}},
        }
    )
    merged = a.aggregate(b)
    assert merged.get("hit_tokens", "cpu") == 48
    assert merged.get("hit_tokens", "storage") == 16
    assert merged.get("storage_breaker_state") == 1
    assert merged.get("load_seconds") == [0.1, 0.2, 0.3]
    assert merged.reduce()["load_seconds_count"] == 3
    assert HiMambaStats().is_empty() and not merged.is_empty()
