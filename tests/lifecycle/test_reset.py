"""``reset_prefix_cache(reset_connector=True)`` while a load is in flight: the load ends
cleanly, and nothing cached before the reset reaches a request that arrives after it, neither
from the CPU tier nor from storage. Requests that arrive after the reset compute different
bytes (the reset stands for a weight update), so a stale byte fails CHECK."""

from __future__ import annotations

import pytest
from vllm.v1.engine import FinishReason

from .conftest import connector_config
from .leaks import assert_no_leaks
from .workload import cache_prefix, prompt_of, schedule_until_loading


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("when", ["before_execute", "before_update", "before_forward"])
def test_reset_during_load_serves_nothing_stale(make_engine, store_url, async_scheduling, when):
    engine = make_engine(
        async_scheduling=async_scheduling, connector_config=connector_config(store_url)
    )
    p1, p2 = prompt_of(51, 80), prompt_of(52, 80)
    cache_prefix(engine, "a1", p1, max_tokens=3)
    cache_prefix(engine, "a2", p2, max_tokens=3)
    assert_no_leaks(engine)  # also lets write-through land: p1 and p2 are in storage too
    engine.add_request("b", p1, max_tokens=3)
    so = schedule_until_loading(engine, "b")
    if when == "before_execute":
        engine.reset_prefix_cache()
    mro = engine.execute(so)
    if when == "before_update":
        engine.reset_prefix_cache()
    engine.update(so, mro)
    if when == "before_forward":
        engine.reset_prefix_cache()
    engine.run_until_idle()
    assert engine.records["b"].finish == FinishReason.LENGTH
    assert engine.records["b"].output == engine.records["a1"].output
    # p2 was cached (host and storage) before the reset; c arrives after it.
    engine.add_request("c", p2, max_tokens=3)
    engine.run_until_idle()
    assert all(not n for n, _ in engine.lookups["c"]), engine.lookups["c"]
    assert engine.records["c"].finish == FinishReason.LENGTH
    assert_no_leaks(engine)
