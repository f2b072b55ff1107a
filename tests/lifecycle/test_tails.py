"""Partial tails on vLLM's real scheduler: a finished request's blocks come back to vLLM one
step after it finishes, and the next turn resumes inside a block from the CPU tier with
exactly the bytes a recompute would produce (the runner checks every byte it reads)."""

from __future__ import annotations

from .conftest import connector_config
from .leaks import assert_no_leaks
from .workload import prompt_of


def test_tail_blocks_come_back_one_step_after_the_request_finishes(make_engine):
    engine = make_engine(connector_config=connector_config(partial_tail_hits=True))
    pool = engine.scheduler.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    bs = engine.kv.block_size
    prompt = prompt_of(1, 3 * bs + 5)
    engine.add_request("a", prompt, max_tokens=2)
    engine.run_until(lambda: engine.records["a"].finish is not None)
    # vLLM holds the blocks while the workers copy the tail...
    assert "a" in engine.scheduler.requests
    assert pool.get_num_free_blocks() < free_at_start
    engine.step()
    # ...and has them back after one step (the copy is reported the step it runs).
    assert "a" not in engine.scheduler.requests
    assert pool.get_num_free_blocks() == free_at_start
    assert engine.connector.stats()["tails_stored"] == 1

    # The next turn (prompt, answer, new message) hits every token "a" computed, from the CPU
    # tier once vLLM's own copy is gone, and continues as a recompute would.
    assert engine.scheduler.reset_prefix_cache()
    turn = prompt + engine.records["a"].output + prompt_of(2, 7)
    engine.add_request("b", turn, max_tokens=3)
    engine.run_until_idle()
    computed = len(prompt) + 1  # the last sampled token was never run through the model
    assert computed % bs
    assert engine.lookups["b"][-1] == (computed, True), engine.lookups["b"]
    assert engine.hits.host == computed, engine.hits
    assert engine.connector.stats()["tail_hits"] == 1
    assert engine.records["b"].finish is not None and len(engine.records["b"].output) == 3
    assert_no_leaks(engine)
