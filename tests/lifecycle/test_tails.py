"""Partial tails on vLLM's real scheduler: a finished request's blocks go back to vLLM as it
finishes (its tail is copied in the next step's first hook, before vLLM can reuse them), and
the next turn resumes inside a block from the CPU tier with exactly the bytes a recompute
would produce (the runner checks every byte it reads)."""

from __future__ import annotations

import pytest

from himamba.connector.worker.worker_half import RunnerOrder

from .conftest import connector_config
from .faults import StorageFaults, faulty_storage
from .leaks import assert_no_leaks
from .workload import prompt_of, waiting_on_connector


@pytest.mark.parametrize(
    "v2,hook",
    [(False, False), (True, True), (True, False)],
    ids=["runner_v1", "runner_v2", "runner_v2-no_hook"],
)
def test_tail_blocks_go_back_at_once_and_are_copied_before_reuse(make_engine, v2, hook):
    """vLLM has a finished request's blocks back at once, and reuses a partly filled block
    first: a newcomer takes them in the very step that copies the tail. Model Runner V1 calls
    the connector's first hook before it zeroes the newcomer's blocks, and V2 (a GPU engine's
    default) calls himamba's step-start hook before it does: the tail is copied first. V2
    without that hook (HIMAMBA_V2_STEP_HOOK=0) zeroes them first: the tail would be the
    newcomer's zeros, so it is given up and the next turn hits to the last full block. Either
    way every byte read back is a's."""
    lost = v2 and not hook
    engine = make_engine(
        num_gpu_blocks=20,
        max_model_len=256,
        model_runner_v2=v2,
        v2_step_hook=hook,
        connector_config=connector_config(partial_tail_hits=True),
    )
    assert engine.runners[0].connector.step_hook_installed == hook
    pool = engine.scheduler.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    bs = engine.kv.block_size
    prompt = prompt_of(1, 3 * bs + 5)
    engine.add_request("a", prompt, max_tokens=2)
    engine.step()
    used_by_a = free_at_start - pool.get_num_free_blocks()
    engine.run_until(lambda: engine.records["a"].finish is not None)
    # vLLM has the blocks back as the request finishes (nothing held for the copy)...
    assert "a" not in engine.scheduler.requests
    assert pool.get_num_free_blocks() == free_at_start
    # ...and a request arriving now takes some of them in the very step that copies the tail:
    # vLLM zeroes them and the forward writes them.
    engine.add_request("x", prompt_of(5, 16 * bs - 2), max_tokens=1)
    engine.step()
    assert free_at_start - pool.get_num_free_blocks() > free_at_start - used_by_a
    stats = engine.connector.stats()
    assert stats["tails_stored"] == 1
    assert stats["tails_overwritten"] == int(lost), stats
    engine.run_until_idle()

    # The next turn (prompt, answer, new message) hits every token "a" computed (or, lost, to
    # its last full block), from the CPU tier once vLLM's own copy is gone, and continues as a
    # recompute would.
    assert engine.scheduler.reset_prefix_cache()
    turn = prompt + engine.records["a"].output + prompt_of(2, 7)
    engine.add_request("b", turn, max_tokens=3)
    engine.run_until_idle()
    computed = len(prompt) + 1  # the last sampled token was never run through the model
    assert computed % bs
    hit = computed - computed % bs if lost else computed
    assert engine.lookups["b"][-1] == (hit, True), engine.lookups["b"]
    assert engine.hits.host == hit, engine.hits
    assert engine.connector.stats()["tail_hits"] == int(not lost)
    assert engine.records["b"].finish is not None and len(engine.records["b"].output) == 3
    assert_no_leaks(engine)


def _next_turn_hits_every_computed_token(engine, rid: str, computed: int) -> None:
    """After vLLM's own copy is gone, a next turn of ``rid`` hits ``computed`` tokens (inside
    a block) from the CPU tier; the runner checks every row and state it reads."""
    rec = engine.records[rid]
    assert engine.scheduler.reset_prefix_cache()
    engine.add_request(rid + "-next", rec.prompt + rec.output + prompt_of(9, 7), max_tokens=3)
    engine.run_until_idle()
    assert engine.lookups[rid + "-next"][-1] == (computed, True), engine.lookups[rid + "-next"]
    assert engine.records[rid + "-next"].finish is not None


def test_tails_under_async_scheduling_cover_the_forward_in_flight(make_engine):
    """vLLM's AsyncScheduler (a GPU engine's default) schedules a request's next step before
    the previous one's output is in. A request that stops on its length has no step in flight
    (its tail is what it computed); one aborted between steps has one, taking the token vLLM
    has just appended, so its tail covers every token it holds, state included."""
    engine = make_engine(
        async_scheduling=True, connector_config=connector_config(partial_tail_hits=True)
    )
    assert type(engine.scheduler).__name__ == "AsyncScheduler"
    bs = engine.kv.block_size
    prompt = prompt_of(1, 3 * bs + 5)
    engine.add_request("a", prompt, max_tokens=4)
    engine.run_until_idle()
    assert len(engine.records["a"].output) == 4
    assert engine.connector.stats()["tails_stored"] == 1
    _next_turn_hits_every_computed_token(engine, "a", len(prompt) + 3)

    # Aborted while decoding, at a point where vLLM's engine loop takes aborts: the step in
    # flight runs the last token the request was given.
    engine.add_request("b", prompt_of(2, 2 * bs + 3), max_tokens=50)
    engine.run_until(lambda: len(engine.records["b"].output) >= 6)
    req = engine.scheduler.requests["b"]
    assert req.num_output_placeholders == 1 and req.num_computed_tokens == req.num_tokens
    held = len(engine.records["b"].prompt) + len(engine.records["b"].output)
    assert held % bs
    engine.abort(["b"])
    engine.run_until_idle()
    assert engine.connector.stats()["tails_stored"] == 3  # a's, a-next's, b's
    _next_turn_hits_every_computed_token(engine, "b", held)
    assert engine.connector.stats()["tails_unnamed"] == 0
    assert_no_leaks(engine)


def test_async_tail_is_skipped_when_a_forward_in_flight_takes_an_unseen_token(
    make_engine, store_url
):
    """Two steps of one request in flight (more batches than vLLM queues today): the later
    one takes a token the earlier one samples, which vLLM has not seen. No length names the
    state it leaves (the tokens vLLM holds name a state one token earlier), so an abort then
    keeps no tail, and a next turn over the tokens vLLM saw, from storage after the CPU tier
    is dropped, reads only exact bytes."""
    engine = make_engine(
        async_scheduling=True,
        connector_config=connector_config(store_url, partial_tail_hits=True),
    )
    bs = engine.kv.block_size
    engine.add_request("c", prompt_of(3, 2 * bs + 3), max_tokens=50)
    engine.run_until(lambda: len(engine.records["c"].output) >= 3)
    so = engine.schedule()  # a second batch while the first is still in flight
    engine._queue.appendleft((so, engine.execute(so)))
    req = engine.scheduler.requests["c"]
    assert req.num_computed_tokens == req.num_tokens + 1
    seen = len(engine.records["c"].prompt) + len(engine.records["c"].output)
    engine.abort(["c"])
    engine.run_until_idle()
    stats = engine.connector.stats()
    assert stats["tails_unnamed"] == 1 and stats["tails_stored"] == 0, stats
    assert_no_leaks(engine)  # nothing held, and the full blocks' write-through landed
    assert engine.scheduler.reset_prefix_cache()
    engine.connector.drop_host_tier()
    rec = engine.records["c"]
    engine.add_request("c-next", rec.prompt + rec.output[: seen - len(rec.prompt)] + [7] * 9)
    engine.run_until_idle()
    assert engine.lookups["c-next"][-1][0] == 2 * bs, engine.lookups["c-next"]
    assert_no_leaks(engine)


def test_reset_right_after_a_request_finishes_drops_its_tail(make_engine, store_url):
    """A weight update's reset can come in the engine's next call, before the step that would
    copy the finished request's tail: nothing holds vLLM's blocks, so vLLM's reset succeeds
    at once. The tail's bytes are the old weights': once the same prompt has run under the new
    ones (its blocks stored under the new key epoch), a next turn continuing the old answer
    must hit those blocks and not the old tail, in the CPU tier or in storage."""
    engine = make_engine(connector_config=connector_config(store_url, partial_tail_hits=True))
    bs = engine.kv.block_size
    prompt = prompt_of(11, 3 * bs + 5)
    engine.add_request("a", prompt, max_tokens=2)
    engine.run_until(lambda: engine.records["a"].finish is not None)
    assert engine.reset_prefix_cache()  # new model epoch: every byte computed so far is stale
    engine.add_request("a2", prompt, max_tokens=2)
    engine.run_until_idle()
    assert engine.records["a2"].output != engine.records["a"].output  # new weights
    assert_no_leaks(engine)  # write-through landed

    def tail_hits() -> int:
        return engine.connector.stats()["tail_hits"]

    for tier in ("host", "storage"):
        if tier == "storage":
            engine.connector.drop_host_tier()
        assert engine.scheduler.reset_prefix_cache()  # vLLM's own copy gone, same weights
        # The old answer continued: the new weights' blocks hit, the old tail must not (the
        # runner raises if a byte of the old weights is read).
        before = tail_hits()
        old_turn = prompt + engine.records["a"].output + prompt_of(12, 7)
        engine.add_request("old-" + tier, old_turn, max_tokens=3)
        engine.run_until_idle()
        assert engine.lookups["old-" + tier][-1][0] == 3 * bs, engine.lookups
        assert tail_hits() == before
        # The new answer continued: hits through its own tail. From the CPU tier with vLLM's
        # own cache holding the full blocks (the old turn's): only the 6 tokens past them.
        # From storage (probed only when the CPU tier lacks blocks) with both tiers empty:
        # all of it.
        if tier == "storage":
            engine.connector.drop_host_tier()
            assert engine.scheduler.reset_prefix_cache()
        new_turn = prompt + engine.records["a2"].output + prompt_of(13, 7)
        engine.add_request("new-" + tier, new_turn, max_tokens=3)
        engine.run_until_idle()
        local = 3 * bs if tier == "host" else 0
        assert engine.lookups["new-" + tier][-1] == (len(prompt) + 1 - local, True)
        assert tail_hits() == before + 1
    assert_no_leaks(engine)


def test_tail_in_the_slot_of_a_fetch_given_up_the_same_step(make_engine, store_url):
    """A storage fetch in flight is given up (its request aborted) and, in the same pause
    between steps, another request's tail takes the Mamba slot the fetch had (the pool hands
    out the slot freed last). The worker must apply the plan's cancel (which moves a slot still
    lent to the adapter onto spare memory) before it copies the tail into that slot: copied
    first, the tail's bytes would leave with the old memory and the slot would hold whatever
    the spare held. The next turn then reads the tail from the CPU tier, bytes checked."""
    cfg = connector_config(
        store_url, partial_tail_hits=True, storage={"prefetch_timeout_base_s": 10.0}
    )
    doc = prompt_of(21, 80)
    writer = make_engine(connector_config=cfg)
    writer.add_request("d", doc, max_tokens=1)
    writer.run_until_idle()
    writer.close()  # flushes write-through: the prefix is now only in storage
    with faulty_storage(StorageFaults()) as faults:
        engine = make_engine(connector_config=cfg)
        bs = engine.kv.block_size
        prompt = prompt_of(22, 3 * bs + 5)
        engine.add_request("a", prompt, max_tokens=50)
        engine.run_until(lambda: len(engine.records["a"].output) >= 2)
        faults.hold_loads.set()  # the fetch below stays in flight
        engine.add_request("f", doc + prompt_of(23, 5), max_tokens=2)
        engine.run_until(lambda: faults.counts.get("submitted_loads", 0) > 0)
        engine.step()
        assert waiting_on_connector(engine, "f"), engine.lookups["f"]
        engine.abort(["f"])  # its fetch is given up, its slots freed at once...
        engine.abort(["a"])  # ...and a's tail takes the Mamba slot freed last
        computed = len(prompt) + len(engine.records["a"].output) - 1
        assert computed % bs
        engine.step()  # the plan: cancel the fetch, copy the tail
        faults.release()
        assert engine.connector.stats()["tails_stored"] == 1
        engine.run_until_idle()
        assert engine.scheduler.reset_prefix_cache()
        rec = engine.records["a"]
        engine.add_request("a-next", rec.prompt + rec.output + prompt_of(24, 7), max_tokens=2)
        engine.run_until_idle()  # the runner raises if the tail's bytes are not a's
        assert engine.lookups["a-next"][-1] == (computed, True), engine.lookups["a-next"]
        assert_no_leaks(engine)


def test_v2_worker_without_the_hook_refuses_tails_planned_for_one_with_it(make_engine):
    """The scheduler process plans tails for V2 workers with the step-start hook; a worker
    where it could not be installed (another wrapper took V2's ``execute_model`` first, say)
    must fail loudly on such a plan rather than copy blocks vLLM may have zeroed."""
    engine = make_engine(
        model_runner_v2=True, connector_config=connector_config(partial_tail_hits=True)
    )
    conn = engine.runners[0].connector
    conn.worker.runner_order = RunnerOrder.BLOCKS_FIRST  # the install failed here
    bs = engine.kv.block_size
    engine.add_request("a", prompt_of(1, 3 * bs + 5), max_tokens=2)
    with pytest.raises(RuntimeError, match="HIMAMBA_V2_STEP_HOOK=0"):
        engine.run_until_idle()
