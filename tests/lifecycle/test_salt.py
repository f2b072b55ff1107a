"""Same tokens under another cache salt never hit (salts are in the byte model too, so a
cross-salt hit would also fail CHECK)."""

from __future__ import annotations

import pytest

from .conftest import connector_config
from .leaks import assert_no_leaks
from .workload import prompt_of


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_other_salt_gets_no_hit(make_engine, store_url, async_scheduling):
    engine = make_engine(
        async_scheduling=async_scheduling, connector_config=connector_config(store_url)
    )
    prompt = prompt_of(61, 80)
    engine.add_request("alice", prompt, max_tokens=3, cache_salt="alice")
    engine.run_until_idle()
    assert engine.scheduler.reset_prefix_cache()
    engine.add_request("bob", prompt, max_tokens=3, cache_salt="bob")
    engine.add_request("anon", prompt, max_tokens=3)
    engine.run_until_idle()
    for rid in ("bob", "anon"):
        assert all(not n for n, _ in engine.lookups[rid]), (rid, engine.lookups[rid])
    engine.add_request("alice2", prompt, max_tokens=3, cache_salt="alice")
    engine.run_until_idle()
    assert engine.lookups["alice2"][-1] == (64, True)
    assert engine.records["alice2"].output == engine.records["alice"].output
    assert_no_leaks(engine)


def test_other_salt_gets_no_storage_hit(make_engine, store_url):
    cfg = connector_config(store_url)
    prompt = prompt_of(62, 80)
    writer = make_engine(connector_config=cfg)
    writer.add_request("alice", prompt, max_tokens=3, cache_salt="alice")
    writer.run_until_idle()
    writer.close()
    reader = make_engine(connector_config=cfg)
    reader.add_request("bob", prompt, max_tokens=3, cache_salt="bob")
    reader.run_until_idle()
    assert all(not n for n, _ in reader.lookups["bob"]), reader.lookups["bob"]
    reader.add_request("alice", prompt, max_tokens=3, cache_salt="alice")
    reader.run_until_idle()
    assert reader.hits.storage == 64, reader.hits
    assert_no_leaks(reader)
