"""Aborts at every stage of a hit's life leave nothing held, and later hits stay exact."""

from __future__ import annotations

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from .conftest import connector_config
from .faults import StorageFaults, faulty_storage
from .leaks import assert_no_leaks
from .workload import cache_prefix, prompt_of, waiting_on_connector

MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def _serves_exactly_again(engine, prompt, reference: str) -> None:
    """A later request for the same prefix still gets correct bytes (CHECK) and tokens."""
    engine.add_request("again", prompt, max_tokens=3)
    engine.run_until_idle()
    assert engine.records["again"].output[:2] == engine.records[reference].output[:2]


@MODES
def test_abort_after_hit_promised_before_blocks_allocated(make_engine, async_scheduling):
    # 21 usable GPU blocks: a 250-token request holds 18, so a 64-token hit is promised by the
    # connector but vLLM cannot allocate its blocks and keeps the request waiting.
    engine = make_engine(
        async_scheduling=async_scheduling,
        num_gpu_blocks=22,
        max_model_len=256,
        connector_config=connector_config(),
    )
    prompt = prompt_of(1, 80)
    cache_prefix(engine, "a", prompt)
    engine.add_request("hog", prompt_of(2, 250), max_tokens=5)
    for _ in range(3):
        engine.step()
    engine.add_request("b", prompt, max_tokens=2)
    engine.run_until(lambda: bool(engine.lookups.get("b")))
    engine.step()
    assert engine.lookups["b"][-1] == (64, True)
    assert engine.status("b") == RequestStatus.WAITING
    engine.abort(["b"])
    engine.run_until_idle()
    assert engine.records["hog"].finish == FinishReason.LENGTH
    _serves_exactly_again(engine, prompt, "a")
    assert_no_leaks(engine)


@MODES
@pytest.mark.parametrize("when", ["before_execute", "before_update"])
def test_abort_while_loading(make_engine, async_scheduling, when):
    engine = make_engine(async_scheduling=async_scheduling, connector_config=connector_config())
    prompt = prompt_of(3, 80)
    cache_prefix(engine, "a", prompt)
    engine.add_request("b", prompt, max_tokens=3)
    so = engine.schedule()
    assert engine.status("b") == RequestStatus.WAITING_FOR_REMOTE_KVS
    if when == "before_execute":
        engine.abort(["b"])
    mro = engine.execute(so)
    if when == "before_update":
        engine.abort(["b"])
    engine.update(so, mro)
    engine.run_until_idle()
    assert engine.records["b"].finish == FinishReason.ABORT
    _serves_exactly_again(engine, prompt, "a")
    assert_no_leaks(engine)


@MODES
def test_abort_while_waiting_on_storage_probe(make_engine, store_url, async_scheduling):
    with faulty_storage(StorageFaults()) as faults:
        engine = make_engine(
            async_scheduling=async_scheduling,
            connector_config=connector_config(store_url, storage={"prefetch_timeout_base_s": 10.0}),
        )
        prompt = prompt_of(4, 80)
        faults.hold_lookups.set()
        engine.add_request("b", prompt, max_tokens=2)
        engine.run_until(lambda: waiting_on_connector(engine, "b"))
        for _ in range(3):
            engine.step()
        assert waiting_on_connector(engine, "b"), engine.lookups["b"]
        assert engine.status("b") == RequestStatus.WAITING
        engine.abort(["b"])
        faults.release()
        assert_no_leaks(engine)
        engine.add_request("c", prompt, max_tokens=2)
        engine.run_until_idle()
        assert engine.records["c"].finish == FinishReason.LENGTH
        assert_no_leaks(engine)


@MODES
def test_abort_while_waiting_on_storage_fetch(make_engine, store_url, async_scheduling):
    cfg = connector_config(store_url, storage={"prefetch_timeout_base_s": 10.0})
    prompt = prompt_of(5, 80)
    writer = make_engine(connector_config=cfg)
    cache_prefix(writer, "a", prompt)
    writer.close()  # flushes write-through: the prefix is now only in storage
    with faulty_storage(StorageFaults()) as faults:
        engine = make_engine(async_scheduling=async_scheduling, connector_config=cfg)
        faults.hold_loads.set()
        engine.add_request("b", prompt, max_tokens=2)
        engine.run_until(lambda: faults.counts.get("submitted_loads", 0) > 0)
        for _ in range(3):
            engine.step()
        assert waiting_on_connector(engine, "b"), engine.lookups["b"]
        engine.abort(["b"])
        faults.release()
        assert_no_leaks(engine)
        engine.add_request("c", prompt, max_tokens=2)
        engine.run_until_idle()
        assert engine.records["c"].output == writer.records["a"].output
        assert engine.hits.external_hits == 64, engine.hits
        assert_no_leaks(engine)
