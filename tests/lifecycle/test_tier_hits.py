"""A prefix evicted from vLLM's GPU cache comes back from the CPU tier, or from storage in a
fresh engine, with exactly the bytes a recompute would produce."""

from __future__ import annotations

import pytest

from himamba.connector.scheduler.device_blocks import CHECKED_READS

from .conftest import connector_config
from .leaks import assert_no_leaks
from .workload import assert_host_tier_replays, prompt_of


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cpu_tier_hit_restores_exact_bytes(make_engine, async_scheduling):
    engine = make_engine(async_scheduling=async_scheduling, connector_config=connector_config())
    prompt = prompt_of(1, 80)
    engine.add_request("a", prompt, max_tokens=3)
    engine.run_until_idle()
    # Drop vLLM's own copy, so only the connector can serve the prefix.
    assert_host_tier_replays(engine, "b", prompt, like="a", host_tokens=64)
    assert_no_leaks(engine)
    # The stores read vLLM's block tables directly, and those reads agreed with vLLM's
    # public get_block_ids each time they were compared.
    device_blocks = engine.scheduler.connector.scheduler.stores.device_blocks
    assert device_blocks.direct
    assert device_blocks._checks_left < CHECKED_READS
