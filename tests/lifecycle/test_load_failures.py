"""Failed loads: under "recompute" the request is recomputed with exact bytes; under "fail"
it finishes with an error. Either way nothing is held afterwards."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from vllm.v1.engine import FinishReason

from himamba.connector.config import HiMambaConfig

from .conftest import connector_config
from .faults import LoadFaults, StorageFaults, failing_loads, faulty_storage
from .leaks import assert_no_leaks
from .workload import cache_prefix, prompt_of

MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def _policy_config(policy: str) -> dict:
    # himamba may turn vLLM's default "fail" into "recompute" unless told to respect it.
    fields = {f.name for f in dataclasses.fields(HiMambaConfig)}
    if policy == "fail" and "respect_fail_policy" in fields:
        return connector_config(respect_fail_policy=True)
    return connector_config()


@MODES
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_host_load_follows_policy(make_engine, async_scheduling, policy):
    engine = make_engine(
        async_scheduling=async_scheduling,
        kv_load_failure_policy=policy,
        connector_config=_policy_config(policy),
    )
    prompt = prompt_of(21, 80)
    cache_prefix(engine, "a", prompt, max_tokens=3)
    with failing_loads(LoadFaults(fail_next=1)) as faults:
        engine.add_request("b", prompt, max_tokens=3)
        engine.run_until_idle()
    assert faults.failed == 1
    assert engine.lookups["b"][0] == (64, True)
    if policy == "recompute":
        assert engine.records["b"].finish == FinishReason.LENGTH
        assert engine.records["b"].output == engine.records["a"].output
    else:
        assert engine.records["b"].finish == FinishReason.ERROR
        assert engine.records["b"].output == []
    assert_no_leaks(engine)
    # The failure leaves the cached prefix usable for the next request.
    engine.add_request("c", prompt, max_tokens=3)
    engine.run_until_idle()
    assert engine.records["c"].output == engine.records["a"].output
    assert_no_leaks(engine)


@MODES
def test_failed_storage_reads_fall_back_to_recompute(make_engine, store_url, async_scheduling):
    cfg = connector_config(store_url)
    prompt = prompt_of(22, 80)
    writer = make_engine(connector_config=cfg)
    cache_prefix(writer, "a", prompt, max_tokens=3)
    writer.close()
    with faulty_storage(StorageFaults(fail_rate_load=1.0)) as faults:
        engine = make_engine(async_scheduling=async_scheduling, connector_config=cfg)
        engine.add_request("b", prompt, max_tokens=3)
        engine.run_until_idle()
        assert faults.counts.get("failed_load", 0) >= 1, faults.counts
        assert engine.records["b"].finish == FinishReason.LENGTH
        assert engine.records["b"].output == writer.records["a"].output
        assert_no_leaks(engine)


def test_corrupt_stored_object_is_never_served(make_engine, store_url):
    cfg = connector_config(store_url)
    prompt = prompt_of(23, 80)
    writer = make_engine(connector_config=cfg)
    cache_prefix(writer, "a", prompt, max_tokens=3)
    writer.close()
    files = [p for p in Path(store_url.removeprefix("file://")).rglob("*") if p.is_file()]
    assert files, "write-through stored nothing"
    for path in files:  # one flipped bit in the payload of every stored object
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x20
        path.write_bytes(bytes(data))
    engine = make_engine(connector_config=cfg)
    engine.add_request("b", prompt, max_tokens=3)
    engine.run_until_idle()
    assert engine.records["b"].output == writer.records["a"].output
    assert engine.hits.external_hits == 0, engine.hits
    assert_no_leaks(engine)
