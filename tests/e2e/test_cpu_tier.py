"""End to end on a real vLLM CPU engine: prefixes served from the CPU tier are token-exact.

Every comparison is against an engine with no connector at all (float32 for Granite, also with
an fp8 KV cache, Falcon-H1 and Jamba, so equality is exact; Qwen3-Next's CPU GDN kernel needs
bf16, and the hit run computes the same final chunk on the same bytes, so it is exact too).
Nemotron-H runs bf16 with float32 SSM states (``mamba_ssm_cache_dtype``), so its state pages
mix two dtypes.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.offline_engine import prompt
from tests.harness.subprocess_run import run_scenario

pytestmark = pytest.mark.e2e

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (fixture, engine arguments); the block size is read from the engine (vLLM derives
    # it at run time)
    "granite": ("granite_model", {"dtype": "float32"}),
    # fp8 attention KV: the attention page halves, so vLLM doubles the block size
    "granite_fp8_kv": ("granite_model", {"dtype": "float32", "kv_cache_dtype": "fp8"}),
    "qwen3next": ("qwen3next_model", {"dtype": "bfloat16"}),
    "falcon_h1": ("falcon_h1_model", {"dtype": "float32"}),
    "jamba": ("jamba_model", {"dtype": "float32"}),
    "nemotron_h": (
        "nemotron_h_model",
        {"dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32"},
    ),
}
PROMPT_LEN = 1000


def boundary(block_size: int) -> int:
    """Deepest hittable boundary of a PROMPT_LEN prompt: the last token is always recomputed."""
    return (PROMPT_LEN - 1) // block_size * block_size


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_run(request: pytest.FixtureRequest) -> dict[str, Any]:
    fixture, engine = MODELS[request.param]
    model = str(request.getfixturevalue(fixture))
    a = prompt(1, PROMPT_LEN)
    common = {"model": model, **engine}
    ref_a = run_scenario("baseline", {**common, "prompts": [a]})
    block_size = ref_a["block_size"]
    b = a[: boundary(block_size)] + prompt(2, 150)
    ref = {
        "single": ref_a["single"] + run_scenario("baseline", {**common, "prompts": [b]})["single"]
    }
    got = run_scenario(
        "cpu_tier", {**common, "prompts": [a], "after": [b], "extra": {"cpu_cache_gb": 0.05}}
    )
    assert got["block_size"] == block_size
    return {"name": request.param, "block_size": block_size, "ref": ref, "got": got}


# Cache dtypes each model's engine must have laid out (Mamba-type states conv first, then
# attention KV): what the hits above were exact on.
CACHE_DTYPES = {
    "granite": {"mamba": [["float32", "float32"]], "attention": [["float32"]]},
    "granite_fp8_kv": {"mamba": [["float32", "float32"]], "attention": [["uint8"]]},  # fp8 bytes
    "falcon_h1": {"mamba": [["float32", "float32"]], "attention": [["float32"]]},
    "jamba": {"mamba": [["float32", "float32"]], "attention": [["float32"]]},
    "nemotron_h": {"mamba": [["bfloat16", "float32"]], "attention": [["bfloat16"]]},
}


def test_the_engine_kept_the_cache_dtypes_the_model_asks_for(model_run):
    dtypes = model_run["got"]["cache_dtypes"]
    assert dtypes["mamba"], "no Mamba-type cache group: the model ran as a pure transformer"
    if model_run["name"] in CACHE_DTYPES:
        assert dtypes == CACHE_DTYPES[model_run["name"]], dtypes


def test_repeated_prompt_after_gpu_reset_hits_cpu_tier_with_identical_tokens(model_run):
    bs = model_run["block_size"]
    ref_a = model_run["ref"]["single"][0]
    rnd = model_run["got"]["rounds"][0]
    assert rnd["cold"]["cached"] == 0
    assert rnd["cold"]["tokens"] == ref_a["tokens"]
    assert rnd["gpu"]["cached"] == boundary(bs)
    # After reset_prefix_cache() the GPU holds nothing: these tokens came from the CPU tier.
    assert rnd["cpu"]["cached"] == boundary(bs)
    assert rnd["cpu"]["tokens"] == ref_a["tokens"]
    stats = model_run["got"]["stats"]
    assert stats["loads"] >= 1 and stats["hit_tokens"] >= boundary(bs)
    assert stats.get("loads_failed", 0) == 0


def test_prompt_sharing_only_a_prefix_hits_at_the_shared_boundary(model_run):
    bs = model_run["block_size"]
    ref_b = model_run["ref"]["single"][1]
    got_b = model_run["got"]["after"][0]
    assert got_b["cached"] == boundary(bs)
    assert got_b["tokens"] == ref_b["tokens"]


def test_nothing_is_left_locked_or_lost_after_the_run(model_run):
    leaks = model_run["got"]["leaks"]
    assert leaks == {
        "pending_hits": 0,
        "inflight_loads": 0,
        "tracked_requests": 0,
        "no_hit_requests": 0,
        "hit_records": 0,
        "locked_entries": 0,
        "pending_stores": 0,
        "slots_conserved": True,
    }


def test_batch_with_overlapping_prefixes_and_small_cpu_tier_stays_exact(granite_model):
    shared = prompt(10, 512)
    batch = [shared + prompt(20 + i, 200 + 100 * i) for i in range(4)]
    common = {"model": str(granite_model), "dtype": "float32"}
    ref = run_scenario("baseline", {**common, "prompts": [], "batch": batch})
    # 9 KV slots (256 KiB each) and 10 Mamba slots: the 4 prompts need 13 KV blocks.
    got = run_scenario(
        "batch_pressure", {**common, "batch": batch, "extra": {"cpu_cache_gb": 0.003}}
    )
    want = [o["tokens"] for o in ref["batch"]]
    for round_name in ("first", "second", "third"):
        assert [o["tokens"] for o in got[round_name]] == want, round_name
    stats = got["stats"]
    assert stats["host_kv_capacity"] < 13
    assert stats["host_kv_evictions"] + stats["host_mamba_evictions"] > 0
    assert sum(o["cached"] for o in got["second"] + got["third"]) > 0
    assert stats["hit_tokens"] > 0
    assert got["leaks"]["locked_entries"] == 0 and got["leaks"]["slots_conserved"]


def test_failed_load_is_recomputed_with_correct_tokens(granite_model):
    a = prompt(1, PROMPT_LEN)
    got = run_scenario(
        "load_failure",
        {"model": str(granite_model), "prompts": [a], "extra": {"cpu_cache_gb": 0.05}},
    )
    assert got["stats"]["loads_failed"] == 1
    assert got["retry"]["tokens"] == got["cold"]["tokens"]
    assert got["leaks"]["locked_entries"] == 0 and got["leaks"]["inflight_loads"] == 0


def test_multi_process_engine_with_256_token_blocks_caches_prompt_ends(granite_wide_state_model):
    # In a multi-process engine vLLM 0.32 resets cache_config.block_size to the CPU default
    # (128) after start-up while the KV cache uses 256-token blocks; prefill chunks then end
    # between blocks and no prompt-end state is ever cached. The connector keeps it at 256.
    a = prompt(7, PROMPT_LEN)
    out = run_scenario(
        "repeat",
        {"model": str(granite_wide_state_model), "prompts": [a], "extra": {"cpu_cache_gb": 0.1}},
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    bs = out["block_size"]
    assert bs == 256
    assert out["cold"]["cached"] == 0
    assert out["gpu"]["cached"] == boundary(bs)  # vLLM's own cache has the prompt-end state
    assert out["reset"]["cached"] == boundary(bs)  # and so does the CPU tier
    assert out["gpu"]["tokens"] == out["reset"]["tokens"] == out["cold"]["tokens"]
