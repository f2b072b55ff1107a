"""KV events for routers: what enters and leaves our CPU tier and storage, as vLLM publishes it.

vLLM's real scheduler (with its own ZMQ publisher, ``kv_events_config``) drives the connectors
(both roles); a real ZMQ SUB socket on 127.0.0.1 decodes the msgpack batches the way vLLM's
example consumer does (live stream, then the replay socket for anything the live stream
missed). The router's view rebuilt from those events must equal what the tiers really hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from himamba.connector.observability.event_payloads import merge_events
from himamba.connector.observability.storage_events import STORAGE_MEDIUM
from himamba.connector.protocol import ControlAction
from himamba.connector.tree.node import HOST
from tests.harness.kv_events import EventSubscriber, RouterView, per_block
from tests.lifecycle import engine as lifecycle_engine
from tests.lifecycle.engine import LifecycleEngine
from tests.lifecycle.vllm_setup import EngineSpec, make_model_config, make_request, write_model_dir
from tests.lifecycle.workload import prompt_of
from tests.unit.connector.control_engine import switch_storage

CPU_CACHE_GB = 0.5 / 1024  # 192 KV slots, 292 Mamba slots


def host_content(engine: LifecycleEngine) -> tuple[set[int], set[int]]:
    """(KV block hashes, Mamba state hashes) the CPU tier really holds, as published."""
    kv, states = set(), set()
    for x in engine.connector.scheduler.tree.iter_nodes():
        for i, f in enumerate(x.flags):
            if f & HOST:
                kv.add(maybe_convert_block_hash(x.hashes[i]))
        if x.mamba & HOST:
            states.add(maybe_convert_block_hash(x.hashes[-1]))
    return kv, states


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model_dir = write_model_dir(tmp_path_factory.mktemp("events-model"))
    return make_model_config(model_dir, max_model_len=EngineSpec().max_model_len)


@pytest.fixture
def make_engine(
    model_config: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple[LifecycleEngine, EventSubscriber | None]]]:
    """``make_engine(events=True, **spec_fields)``: an engine whose scheduler publishes KV
    events to a fresh subscriber (``events=False``: no publisher configured at all)."""
    built: list[tuple[LifecycleEngine, EventSubscriber | None]] = []
    real = lifecycle_engine.make_vllm_config

    def build(events: bool = True, **fields: Any) -> tuple[LifecycleEngine, EventSubscriber | None]:
        sub = EventSubscriber() if events else None

        def with_events(spec: EngineSpec, mc: Any) -> Any:
            config = real(spec, mc)
            if sub is not None:
                config.kv_events_config = KVEventsConfig(**sub.config())
            return config

        monkeypatch.setattr(lifecycle_engine, "make_vllm_config", with_events)
        engine = LifecycleEngine(dataclasses.replace(EngineSpec(), **fields), model_config)
        monkeypatch.setattr(lifecycle_engine, "make_vllm_config", real)
        built.append((engine, sub))
        return engine, sub

    yield build
    for engine, sub in built:
        engine.close()
        engine.scheduler.kv_event_publisher.shutdown()
        if sub is not None:
            sub.close()


def serve(engine: LifecycleEngine, req_id: str, prompt: list[int], max_tokens: int = 3) -> None:
    engine.add_request(req_id, prompt, max_tokens=max_tokens)
    engine.run_until_idle()


def groups(engine: LifecycleEngine) -> tuple[int, int]:
    layout = engine.connector.scheduler.layout
    return layout.attention[0].group_id, layout.mamba[0].group_id


def flush_storage(engine: LifecycleEngine) -> None:
    """Let every rank's writes finish and their outcomes reach the scheduler."""
    for runner in engine.runners:
        runner.connector.worker.flush_storage(10)
    engine.idle_steps(2)


def test_cpu_tier_events_mirror_what_the_host_tier_holds(make_engine):
    engine, sub = make_engine(connector_config={"cpu_cache_gb": 0.05 / 1024})  # 19 KV slots
    for i in range(8):
        serve(engine, f"r{i}", prompt_of(30 + i, 96))
    view = RouterView(sub.drain())
    attn, mamba = groups(engine)
    kv, states = host_content(engine)
    assert kv and states
    assert view.held[("CPU", attn)] == kv
    assert view.held[("CPU", mamba)] == states
    assert view.removed[("CPU", attn)] > 0  # the tier was full: evictions were announced
    assert view.held[("GPU", attn)]  # vLLM's own GPU events share the stream
    for ev in view.stored[("CPU", attn)]:
        assert ev.kv_cache_spec_kind == "full_attention" and ev.block_size == 16
    assert all(ev.kv_cache_spec_kind == "mamba" for ev in view.stored[("CPU", mamba)])
    # A reset drops the tier through the cascade; each block's removal is announced.
    assert engine.reset_prefix_cache()
    engine.idle_steps(1)
    view = RouterView(sub.drain())
    assert host_content(engine) == (set(), set())
    assert view.held[("CPU", attn)] == set() and view.held[("CPU", mamba)] == set()


def test_stored_event_carries_the_blocks_tokens_and_parent_chain(make_engine):
    engine, sub = make_engine(connector_config={"cpu_cache_gb": CPU_CACHE_GB})
    prompt = prompt_of(40, 80)
    serve(engine, "a", prompt, max_tokens=20)
    tokens = prompt + engine.records["a"].output
    hashes = make_request("x", tokens, 1, engine.kv.hash_block_size).block_hashes
    published = [maybe_convert_block_hash(h) for h in hashes]
    index = {h: i for i, h in enumerate(published)}
    attn, mamba = groups(engine)
    view = RouterView(sub.drain())
    chain: list[int] = []
    for ev in view.stored[("CPU", attn)]:  # one event per step's run, each continuing the last
        assert ev.parent_block_hash == (chain[-1] if chain else None)
        first = len(chain)
        chain += ev.block_hashes
        assert ev.token_ids == tokens[16 * first : 16 * len(chain)]
    assert chain == published[: len(chain)]
    assert len(chain) == (len(prompt) + 20 - 1) // 16  # through the decode blocks
    for state in view.stored[("CPU", mamba)]:
        (h,) = state.block_hashes
        i = index[h]
        assert state.token_ids == tokens[16 * i : 16 * (i + 1)]
        assert state.parent_block_hash == (published[i - 1] if i else None)


def test_storage_events_follow_completed_writes_and_fetches_are_announced_on_load(
    make_engine, tmp_path
):
    cfg = {"cpu_cache_gb": CPU_CACHE_GB, "storage": {"url": f"file://{tmp_path}"}}
    disk = STORAGE_MEDIUM
    assert disk == "STORAGE"  # vLLM's own medium name for its secondary tiers
    prompt = prompt_of(41, 80)
    writer, sub = make_engine(connector_config=cfg)
    serve(writer, "a", prompt)
    flush_storage(writer)
    view = RouterView(sub.drain())
    attn, mamba = groups(writer)
    # write_through: everything the CPU tier took was written, and announced with its payload.
    assert view.held[(disk, attn)] == view.held[("CPU", attn)] != set()
    assert view.held[(disk, mamba)] == view.held[("CPU", mamba)] != set()
    assert per_block(view.stored[(disk, attn)]) == per_block(view.stored[("CPU", attn)])
    writer.close()

    reader, sub2 = make_engine(connector_config=cfg)
    serve(reader, "b", prompt)
    assert reader.hits.storage == 64
    view2 = RouterView(sub2.drain())
    hashes = make_request("x", prompt, 1, reader.kv.hash_block_size).block_hashes
    fetched = {maybe_convert_block_hash(h) for h in hashes[:4]}
    assert fetched <= view2.held[("CPU", attn)]
    by_hash = {h: ev for ev in view2.stored[("CPU", attn)] for h in ev.block_hashes}
    assert by_hash[maybe_convert_block_hash(hashes[0])].token_ids[:16] == prompt[:16]
    kv, states = host_content(reader)
    assert view2.held[("CPU", attn)] == kv and view2.held[("CPU", mamba)] == states


def test_storage_capacity_evictions_are_announced_as_removed(make_engine, tmp_path):
    storage = {"url": f"file://{tmp_path}", "capacity_gb": 16 * 2200 / 2**30}  # ~16 objects
    engine, sub = make_engine(connector_config={"cpu_cache_gb": CPU_CACHE_GB, "storage": storage})
    for i in range(4):
        serve(engine, f"r{i}", prompt_of(50 + i, 96))
        flush_storage(engine)
    view = RouterView(sub.drain())
    attn, mamba = groups(engine)
    disk = STORAGE_MEDIUM
    assert view.removed[(disk, attn)] > 0
    kept = engine.runners[0].connector.leak_report()["storage_lru_objects"]
    assert len(view.held[(disk, attn)]) + len(view.held[(disk, mamba)]) == kept


def test_tp2_storage_object_is_announced_once_both_ranks_wrote_their_shard(make_engine, tmp_path):
    cfg = {"cpu_cache_gb": CPU_CACHE_GB, "storage": {"url": f"file://{tmp_path}"}}
    engine, sub = make_engine(tensor_parallel_size=2, connector_config=cfg)
    serve(engine, "a", prompt_of(42, 80))
    flush_storage(engine)
    view = RouterView(sub.drain())
    attn, _ = groups(engine)
    announced = [h for ev in view.stored[(STORAGE_MEDIUM, attn)] for h in ev.block_hashes]
    assert announced and len(announced) == len(set(announced))
    assert set(announced) == view.held[("CPU", attn)]


def test_storage_attached_at_run_time_is_announced_like_at_start_up(make_engine, tmp_path):
    engine, sub = make_engine(connector_config={"cpu_cache_gb": CPU_CACHE_GB})  # no storage
    switch_storage(engine, ControlAction.ATTACH, {"url": f"file://{tmp_path}"})
    serve(engine, "a", prompt_of(44, 80))
    flush_storage(engine)
    view = RouterView(sub.drain())
    attn, mamba = groups(engine)
    assert view.held[(STORAGE_MEDIUM, attn)] == view.held[("CPU", attn)] != set()
    assert view.held[(STORAGE_MEDIUM, mamba)] == view.held[("CPU", mamba)] != set()
    assert {ev.ownership for ev in view.stored[(STORAGE_MEDIUM, attn)]} == {"fs_native"}


def test_detach_and_reset_retract_everything_storage_was_announced_to_hold(make_engine, tmp_path):
    cfg = {"cpu_cache_gb": CPU_CACHE_GB, "storage": {"url": f"file://{tmp_path}"}}
    engine, sub = make_engine(connector_config=cfg)
    attn, mamba = groups(engine)
    serve(engine, "a", prompt_of(45, 80))
    flush_storage(engine)
    assert RouterView(sub.drain()).held[(STORAGE_MEDIUM, attn)]
    # A router must not route to a tier that is gone.
    switch_storage(engine, ControlAction.DETACH)
    view = RouterView(sub.drain())
    assert view.held[(STORAGE_MEDIUM, attn)] == set() == view.held[(STORAGE_MEDIUM, mamba)]
    assert view.held[("CPU", attn)] == host_content(engine)[0] != set()  # the CPU tier stays

    switch_storage(engine, ControlAction.ATTACH)
    serve(engine, "b", prompt_of(46, 80))
    flush_storage(engine)
    assert RouterView(sub.drain()).held[(STORAGE_MEDIUM, attn)]
    # A reset moves the storage key epoch: nothing stored before it can be read again.
    assert engine.reset_prefix_cache()
    engine.idle_steps(1)
    view = RouterView(sub.drain())
    assert view.held[(STORAGE_MEDIUM, attn)] == set() == view.held[(STORAGE_MEDIUM, mamba)]


def test_the_attached_stores_write_policy_decides_the_payload(make_engine, tmp_path):
    write_back = {"url": f"file://{tmp_path}/wb", "write_policy": "write_back"}
    small = 0.05 / 1024  # 19 KV slots: serving a few prompts evicts, and write-back writes
    engine, sub = make_engine(connector_config={"cpu_cache_gb": small, "storage": write_back})
    attn, _ = groups(engine)
    for i in range(6):
        serve(engine, f"r{i}", prompt_of(60 + i, 96))
    flush_storage(engine)
    evicted = RouterView(sub.drain()).stored[(STORAGE_MEDIUM, attn)]
    # Written long after the requests that computed them: nothing describes them any more.
    assert evicted and all(ev.block_size == 0 and not ev.token_ids for ev in evicted)
    # A write_through store attached at run time: each write follows a CPU store, described.
    switch_storage(engine, ControlAction.ATTACH, {"url": f"file://{tmp_path}/wt"})
    serve(engine, "a", prompt_of(47, 80))
    flush_storage(engine)
    view = RouterView(sub.drain())
    written = per_block(view.stored[(STORAGE_MEDIUM, attn)][len(evicted) :])
    on_cpu = per_block(view.stored[("CPU", attn)])
    assert written and all(on_cpu[h] == tokens for h, tokens in written.items())


def test_without_a_publisher_nothing_is_tracked(make_engine, tmp_path):
    cfg = {"cpu_cache_gb": CPU_CACHE_GB, "storage": {"url": f"file://{tmp_path}"}}
    engine, _ = make_engine(events=False, connector_config=cfg)
    serve(engine, "a", prompt_of(43, 80))
    conn = engine.connector
    assert conn.scheduler.events is None and conn.scheduler.tree.observer is None
    assert list(conn.take_events()) == []
    assert engine.runners[0].connector.worker.storage.outcomes is None


def test_merge_joins_a_chain_per_stream_and_keeps_streams_apart():
    def stored(h: int, parent: int | None, group: int, medium: str = "CPU") -> BlockStored:
        return BlockStored(
            block_hashes=[h], parent_block_hash=parent, token_ids=[h] * 2, block_size=2,
            lora_id=None, medium=medium, lora_name=None, group_idx=group,
        )  # fmt: skip

    events = [
        stored(1, None, 0), stored(1, None, 1), stored(2, 1, 0), stored(2, 1, 1),
        stored(7, None, 0, "STORAGE"), stored(9, 5, 0),
        BlockRemoved(block_hashes=[3], medium="CPU", group_idx=0),
        BlockRemoved(block_hashes=[4], medium="CPU", group_idx=0),
    ]  # fmt: skip
    merged = merge_events(events)
    assert [(type(e).__name__, e.medium, e.group_idx, e.block_hashes) for e in merged] == [
        ("BlockStored", "CPU", 0, [1, 2]),
        ("BlockStored", "CPU", 1, [1, 2]),
        ("BlockStored", "STORAGE", 0, [7]),
        ("BlockStored", "CPU", 0, [9]),  # parent 5 does not continue the chain
        ("BlockRemoved", "CPU", 0, [3, 4]),
    ]
    assert merged[0].token_ids == [1, 1, 2, 2]
