"""Serving conditions that used to go wrong, each on a real vLLM CPU engine (float32, exact).

- a weight update's reset must make stored prefixes unreachable (no old bytes after it);
- ``best_effort`` must never wait, yet a request queued behind others hits what it prefetched;
- a cold request must not pay an extra engine step because storage is configured;
- storage that is alive but slow must stop delaying requests (breaker opens);
- vLLM's default ``kv_load_failure_policy="fail"`` must not turn a failed load into a failed
  request, and keeping "fail" on purpose must leak nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.harness.offline_engine import prompt
from tests.harness.subprocess_run import run_scenario

pytestmark = pytest.mark.e2e

PROMPT_LEN = 1000


def hit(block_size: int, n: int = PROMPT_LEN) -> int:
    return (n - 1) // block_size * block_size


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [prompt(51 + i, PROMPT_LEN) for i in range(4)]


@pytest.fixture(scope="module")
def reference(granite_model: Path, prompts: list[list[int]]) -> dict[str, Any]:
    return run_scenario("baseline", {"model": str(granite_model), "prompts": prompts})


def storage(url: Path, **kw: Any) -> dict[str, Any]:
    return {"cpu_cache_gb": 0.05, "storage": {"url": f"file://{url}", **kw}}


def test_reset_after_a_weight_update_serves_nothing_stored_before_it(
    granite_model, prompts, reference, tmp_path
):
    out = run_scenario(
        "storage_reset",
        {"model": str(granite_model), "prompts": prompts[:1], "extra": storage(tmp_path)},
    )
    want, bs = reference["single"][0]["tokens"], out["block_size"]
    assert out["cold"]["tokens"] == want
    # Neither the host tier nor storage (same objects, same keys) may serve pre-reset bytes.
    assert out["after_reset"]["cached"] == 0
    assert out["after_reset"]["tokens"] == want
    # What was computed after the reset is cached and served again.
    assert out["again"]["cached"] == hit(bs)
    assert out["again"]["tokens"] == want
    assert out["leaks"]["locked_entries"] == 0 and out["leaks"]["storage_fetches_open"] == 0


def test_best_effort_never_waits_and_a_queued_request_hits_what_it_prefetched(
    granite_model, prompts, reference, tmp_path
):
    model = str(granite_model)
    run_scenario(
        "storage_writer", {"model": model, "prompts": prompts[:2], "extra": storage(tmp_path)}
    )
    out = run_scenario(
        "best_effort",
        {
            "model": model,
            "prompts": prompts[:2],
            "extra": storage(tmp_path, prefetch_policy="best_effort"),
            "blocker_tokens": 64,
        },
    )
    ref, bs = reference["single"], out["block_size"]
    assert out["alone"]["cached"] == 0  # in storage, but best_effort went ahead at once
    assert out["alone"]["tokens"] == ref[0]["tokens"]
    # Queued behind a decode, the second prompt's fetch landed before it was scheduled.
    assert out["queued"]["cached"] == hit(bs)
    assert out["queued"]["tokens"] == ref[1]["tokens"]
    assert out["stats"]["storage_fetched"] >= hit(bs) // bs
    assert out["stats"]["hit_tokens_storage"] == hit(bs)
    assert out["leaks"]["storage_fetches_open"] == 0 and out["leaks"]["locked_entries"] == 0


def test_cold_request_takes_no_extra_engine_step_when_storage_is_configured(
    granite_model, prompts, reference, tmp_path
):
    model = str(granite_model)
    args = {"model": model, "prompts": prompts[2:4]}
    plain = run_scenario("storage_steps", {**args, "extra": {"cpu_cache_gb": 0.05}})
    run_scenario(
        "storage_writer", {"model": model, "prompts": prompts[3:4], "extra": storage(tmp_path)}
    )
    stored = run_scenario("storage_steps", {**args, "extra": storage(tmp_path)})
    assert stored["cold"]["cached"] == 0
    assert stored["cold_steps"] == plain["cold_steps"]
    assert stored["cold"]["tokens"] == reference["single"][2]["tokens"]
    # The second prompt is in storage: it still hits, token-exact.
    assert stored["second"]["cached"] == hit(stored["block_size"])
    assert stored["second"]["tokens"] == reference["single"][3]["tokens"]


def test_slow_but_alive_storage_opens_the_breaker_and_requests_stop_waiting(
    granite_model, prompts, reference, tmp_path
):
    extra = storage(
        tmp_path,
        prefetch_timeout_base_s=0.3,
        prefetch_timeout_per_ki_token_s=0.0,
        prefetch_timeout_max_s=0.3,
        breaker_failures=2,
        breaker_cooldown_s=60.0,
    )
    out = run_scenario(
        "slow_storage",
        {"model": str(granite_model), "prompts": prompts, "extra": extra, "delay_s": 1.5},
    )
    assert [o["tokens"] for o in out["outs"]] == [r["tokens"] for r in reference["single"]]
    stats = out["stats"]
    # Two requests waited out their deadline; after that the breaker was open.
    assert stats["storage_probing_timeouts"] == 2
    assert "open" in out["breaker"].lower()
    # Held back by the scheduler: the first request for its probe's deadline, the last not at
    # all (measured in its lookups, not in wall time, which a busy box stretches).
    waits = [(o["wait_s"], o["asked_again"]) for o in out["outs"]]
    assert waits[0][0] >= 0.3 and waits[0][1] > 0, waits
    assert waits[2][1] == waits[3][1] == 0, waits
    assert out["leaks"]["storage_requests"] == 0


@pytest.mark.parametrize("respect", [False, True])
def test_vllm_default_fail_policy_recomputes_unless_kept_and_never_leaks(
    granite_model, prompts, respect
):
    extra = {"cpu_cache_gb": 0.05, "respect_fail_policy": respect}
    got = run_scenario(
        "load_failure",
        {"model": str(granite_model), "prompts": prompts[:1], "extra": extra, "policy": "fail"},
    )
    assert got["stats"]["loads_failed"] == 1
    if respect:
        assert got["policy"] == "fail"
        assert "error" in got["retry"] or got["retry"]["finish"] not in ("length", "stop")
    else:
        assert got["policy"] == "recompute"
        assert got["retry"]["tokens"] == got["cold"]["tokens"]
    leaks = got["leaks"]
    assert leaks["no_hit_requests"] == 0 and leaks["inflight_loads"] == 0
    assert leaks["tracked_requests"] == 0 and leaks["locked_entries"] == 0
