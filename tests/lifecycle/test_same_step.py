"""One prefix asked for by several requests admitted in the same step."""

from __future__ import annotations

import pytest

from .conftest import connector_config
from .leaks import assert_no_leaks
from .workload import cache_prefix, prompt_of


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "cold"])
def test_prefix_requested_twice_in_one_step(make_engine, async_scheduling, cached):
    engine = make_engine(async_scheduling=async_scheduling, connector_config=connector_config())
    prompt = prompt_of(41, 80)
    if cached:
        cache_prefix(engine, "a", prompt, max_tokens=3)
    engine.add_request("b1", prompt, max_tokens=3)
    engine.add_request("b2", prompt, max_tokens=3)
    engine.add_request("b3", prompt + prompt_of(42, 24), max_tokens=3)
    engine.run_until_idle()
    assert engine.records["b1"].output == engine.records["b2"].output
    if cached:
        assert engine.records["b1"].output == engine.records["a"].output
        assert engine.hits.external_hits >= 64, engine.hits
    assert_no_leaks(engine)
    # Whatever was stored from the duplicates serves a later request exactly.
    assert engine.scheduler.reset_prefix_cache()
    engine.add_request("later", prompt + prompt_of(42, 24), max_tokens=3)
    engine.run_until_idle()
    assert engine.records["later"].output == engine.records["b3"].output
    assert_no_leaks(engine)
