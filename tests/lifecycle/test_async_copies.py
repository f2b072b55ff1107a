"""Copies run off the step (issue 9): a step returns while its stores are still copying, the
next step's first hook waits for them before any block can be rewritten, bytes stay exact,
and write-through reaches storage with no further request."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from himamba.tiers.transfer import CopyPlan

from .conftest import connector_config
from .leaks import assert_no_leaks
from .workload import assert_host_tier_replays, prompt_of


@contextmanager
def held_first_store() -> Iterator[tuple[threading.Event, threading.Event]]:
    """Hold the copy thread inside the first store until ``release`` is set; ``started`` says
    it got there. Later copies run normally."""
    real = CopyPlan.run_host
    started, release = threading.Event(), threading.Event()
    held = [False]

    def run_host(plan: CopyPlan) -> None:
        if plan.to_host and plan.nbytes and not held[0]:
            held[0] = True
            started.set()
            release.wait(30)
        real(plan)

    CopyPlan.run_host = run_host  # type: ignore[method-assign]
    try:
        yield started, release
    finally:
        release.set()
        CopyPlan.run_host = real  # type: ignore[method-assign]


def _worker(engine):  # noqa: ANN001, ANN202
    return engine.runners[0].connector.worker


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_does_not_wait_for_its_stores_and_the_next_step_fences_them(
    make_engine, async_scheduling
):
    engine = make_engine(async_scheduling=async_scheduling, connector_config=connector_config())
    prompt = prompt_of(61, 80)
    with held_first_store() as (started, release):
        engine.add_request("a", prompt, max_tokens=3)
        for _ in range(20):  # steps until the prefill's stores were submitted
            engine.step()
            if started.wait(0.5):  # the copy thread reaches the held store within ms
                break
        assert started.is_set(), "no store was ever submitted"
        # That step returned with its store still copying (held on the copy thread).
        held = _worker(engine).copies.store_jobs()
        assert held
        # vLLM's runner zeroes and copies blocks in _update_states, right after the step's first
        # connector hook: by then the held store must have finished reading its blocks.
        runner = engine.runners[0]
        real_update = runner._update_states
        unfenced_at_update: list[set[int]] = []

        def update_states(so):  # noqa: ANN001, ANN202
            unfenced_at_update.append(held & _worker(engine).copies.store_jobs())
            return real_update(so)

        runner._update_states = update_states
        timer = threading.Timer(0.3, release.set)
        timer.start()
        t0 = time.monotonic()
        engine.step()  # its first hook must wait for the held store
        waited = time.monotonic() - t0
        timer.join()
        runner._update_states = real_update
        assert waited >= 0.25, f"the next step did not fence the store ({waited:.3f} s)"
        assert unfenced_at_update == [set()], "blocks were updated before the store finished"
        assert not held & _worker(engine).copies.store_jobs()  # fenced (new ones may exist)
        engine.run_until_idle()
    # The stored bytes are the ones the forward wrote.
    assert_host_tier_replays(engine, "b", prompt, like="a", host_tokens=64)
    assert_no_leaks(engine)


@pytest.mark.parametrize("hook", [True, False], ids=["step_hook", "no_hook"])
def test_under_model_runner_v2_no_store_reads_a_block_vllm_updates(make_engine, hook):
    """Model Runner V2 (a GPU engine's default) zeroes and copies the next step's new blocks
    before the connector's first hook. himamba's step-start hook (wrapping V2's
    ``execute_model``) fences the last step's stores before that; without it
    (HIMAMBA_V2_STEP_HOOK=0), where no device stream orders the copies (this CPU copy engine),
    the step that submits stores waits for them. Either way none is still reading when vLLM
    next updates blocks, and the bytes are exact."""
    engine = make_engine(
        model_runner_v2=True, v2_step_hook=hook, connector_config=connector_config()
    )
    assert engine.runners[0].connector.step_hook_installed == hook
    runner = engine.runners[0]
    real_update = runner._update_states
    in_flight_at_update: list[set[int]] = []

    def update_states(so):  # noqa: ANN001, ANN202
        in_flight_at_update.append(set(_worker(engine).copies.store_jobs()))
        return real_update(so)

    runner._update_states = update_states
    prompt = prompt_of(63, 80)
    with held_first_store() as (started, release):

        def release_later() -> None:
            if started.wait(30):
                time.sleep(0.3)
            release.set()

        releaser = threading.Thread(target=release_later)
        releaser.start()
        engine.add_request("a", prompt, max_tokens=3)
        engine.run_until_idle()
        releaser.join()
    runner._update_states = real_update
    assert started.is_set(), "no store was ever submitted"
    assert len(in_flight_at_update) > 3
    assert not any(in_flight_at_update), "blocks were updated with a store still copying"
    assert_host_tier_replays(engine, "b", prompt, like="a", host_tokens=64)
    assert_no_leaks(engine)


def test_write_through_lands_in_storage_without_another_request(make_engine, store_url):
    engine = make_engine(connector_config=connector_config(store_url))
    engine.add_request("a", prompt_of(62, 80), max_tokens=3)
    engine.run_until_idle()  # vLLM keeps stepping while the connector has push work
    storage = _worker(engine).storage
    assert _worker(engine).copies.in_flight()["stores_in_flight"] == 0
    deadline = time.monotonic() + 10
    while storage.counters["storage_puts_ok"] < 5 and time.monotonic() < deadline:
        storage.poll()
        time.sleep(0.01)
    # 80 tokens at 16 per block: 5 KV blocks, and Mamba states, all written through.
    assert storage.counters["storage_puts_ok"] >= 5, storage.counters
