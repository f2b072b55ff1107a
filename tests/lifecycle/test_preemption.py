"""A request preempted after its prefix came from the connector resumes with exact bytes."""

from __future__ import annotations

import pytest
from vllm.v1.engine import FinishReason

from .conftest import connector_config
from .leaks import assert_no_leaks
from .workload import cache_prefix, prompt_of


@pytest.mark.parametrize(
    "async_scheduling,v2",
    [(False, False), (True, False), (True, True)],
    ids=["sync", "async", "async-runner_v2"],
)
def test_preempted_after_hit_resumes_exactly(make_engine, async_scheduling, v2):
    # 23 usable blocks; c (90 + 80 tokens) and b (80 + 80) need ~25: the later one, b, is
    # preempted while decoding and comes back (recompute, local or connector hit). Under Model
    # Runner V2 (a GPU engine's default, with async scheduling) vLLM's scheduler sends the
    # resumed request as a new one, every token it holds included.
    engine = make_engine(
        async_scheduling=async_scheduling,
        model_runner_v2=v2,
        num_gpu_blocks=24,
        max_model_len=256,
        connector_config=connector_config(),
    )
    sent_as_new: list[str] = []
    real_schedule = engine.schedule

    def schedule():  # noqa: ANN202
        so = real_schedule()
        sent_as_new.extend(r.req_id for r in so.scheduled_new_reqs if r.req_id == "b")
        return so

    engine.schedule = schedule
    prompt = prompt_of(31, 80)
    cache_prefix(engine, "a", prompt, max_tokens=80)
    engine.add_request("c", prompt_of(32, 90), max_tokens=80)
    engine.step()
    engine.add_request("b", prompt, max_tokens=80)
    preempted = []

    def b_was_preempted() -> bool:
        req = engine.scheduler.requests.get("b")
        if req is not None and req.num_preemptions:
            preempted.append(req.num_preemptions)
        return bool(preempted)

    engine.run_until(b_was_preempted)
    assert engine.lookups["b"][0] == (64, True)
    engine.run_until_idle()
    assert engine.records["b"].finish == FinishReason.LENGTH
    assert engine.records["b"].output == engine.records["a"].output
    assert (len(sent_as_new) > 1) == v2, sent_as_new
    assert_no_leaks(engine)
