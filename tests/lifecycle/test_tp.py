"""TP=2: two worker connectors with their own tensors, merged by vLLM's KVOutputAggregator.
Every byte carries its rank, so a shard restored on the wrong rank fails CHECK."""

from __future__ import annotations

import pytest

from .conftest import connector_config
from .faults import AckFault
from .leaks import assert_no_leaks
from .workload import cache_prefix, prompt_of

MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@MODES
def test_tp2_cpu_hit_restores_each_rank_exactly(make_engine, async_scheduling):
    engine = make_engine(
        async_scheduling=async_scheduling,
        tensor_parallel_size=2,
        connector_config=connector_config(),
    )
    prompt = prompt_of(71, 80)
    cache_prefix(engine, "a", prompt, max_tokens=3)
    engine.add_request("b", prompt, max_tokens=3)
    engine.run_until_idle()
    assert engine.lookups["b"][-1] == (64, True)
    assert engine.records["b"].output == engine.records["a"].output
    assert_no_leaks(engine)


def _storage_only_prefix(make_engine, cfg, prompt):
    writer = make_engine(tensor_parallel_size=2, connector_config=cfg)
    cache_prefix(writer, "a", prompt, max_tokens=3)
    writer.close()
    return writer.records["a"].output


@MODES
@pytest.mark.parametrize("late_rank", [0, 1])
def test_tp2_fetch_acked_by_ranks_in_different_steps(
    make_engine, store_url, async_scheduling, late_rank
):
    cfg = connector_config(store_url)
    prompt = prompt_of(72, 80)
    expected = _storage_only_prefix(make_engine, cfg, prompt)
    engine = make_engine(
        async_scheduling=async_scheduling, tensor_parallel_size=2, connector_config=cfg
    )
    late = AckFault(rank=late_rank, delay_steps=3)
    engine.output_faults.append(late)
    engine.add_request("b", prompt, max_tokens=3)
    engine.run_until_idle()
    assert late.delayed >= 1, "no fetch acknowledgement was delayed"
    assert engine.records["b"].output == expected
    assert engine.hits.storage == 64, engine.hits
    assert_no_leaks(engine)


@MODES
def test_tp2_lost_fetch_ack_neither_hangs_nor_leaks(make_engine, store_url, async_scheduling):
    cfg = connector_config(
        store_url, storage={"prefetch_timeout_base_s": 0.3, "op_deadline_s": 0.5}
    )
    prompt = prompt_of(73, 80)
    expected = _storage_only_prefix(make_engine, cfg, prompt)
    engine = make_engine(
        async_scheduling=async_scheduling, tensor_parallel_size=2, connector_config=cfg
    )
    lost = AckFault(rank=1, drop=True, remaining=1)
    engine.output_faults.append(lost)
    engine.add_request("b", prompt, max_tokens=3)
    engine.run_until_idle(timeout_s=30)
    assert lost.dropped == 1
    assert engine.records["b"].output == expected
    assert_no_leaks(engine)
    # The slots of the unacknowledged fetch are usable again: the prefix still serves.
    engine.add_request("c", prompt, max_tokens=3)
    engine.run_until_idle()
    assert engine.records["c"].output == expected
    assert_no_leaks(engine)
