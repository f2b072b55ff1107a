"""Storage generations through vLLM's real scheduler: a reset made while storage is detached
still makes everything stored before it unreachable once storage is attached again (the epoch
belongs to the scheduler, not to the attached store). Requests after the reset compute
different bytes (the reset stands for a weight update), so a stale byte fails CHECK."""

from __future__ import annotations

import time

from vllm.v1.engine import FinishReason

from himamba.connector.protocol import ControlAction

from .conftest import connector_config
from .leaks import assert_no_leaks
from .workload import cache_prefix, prompt_of


def switch(engine, action: ControlAction, storage: dict | None = None, timeout_s: float = 30.0):
    """Every rank switches (the new store opens off the engine loop); steps run until the
    scheduler half followed."""
    for runner in engine.runners:
        runner.connector.control(action, storage)
    attached = action is ControlAction.ATTACH
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engine.idle_steps(1)
        if (engine.connector.scheduler.storage is not None) == attached:
            return
        time.sleep(0.01)
    raise AssertionError(f"the scheduler never followed {action}")


def test_reset_while_detached_keeps_old_objects_unreachable_after_attach(make_engine, store_url):
    engine = make_engine(connector_config=connector_config(store_url))
    p = prompt_of(61, 80)
    cache_prefix(engine, "a", p, max_tokens=3)
    assert_no_leaks(engine)  # write-through landed: p is in storage
    section = {"url": store_url}
    switch(engine, ControlAction.DETACH)
    assert engine.reset_prefix_cache()  # new weights while no store is attached
    switch(engine, ControlAction.ATTACH, section)
    engine.connector.drop_host_tier()  # only storage could still serve p
    engine.add_request("b", p, max_tokens=3)
    engine.run_until_idle()
    assert all(not n for n, _ in engine.lookups["b"]), engine.lookups["b"]
    assert engine.hits.storage == 0, engine.hits
    assert engine.records["b"].finish == FinishReason.LENGTH
    assert_no_leaks(engine)
