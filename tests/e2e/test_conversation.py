"""Conversations and shared documents on a real vLLM CPU engine (float32: token-exact).

With vLLM's default settings a conversation's next turn must hit through the previous turn's
output (from the CPU tier, and from storage in a fresh process); a prompt that shares only the
first part of an earlier one must hit at the last checkpoint before they diverge; a long
generation must not flood the Mamba pool; and each storage write policy must write what it
promises and give the restart hits it promises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.harness.offline_engine import prompt
from tests.harness.subprocess_run import run_scenario

pytestmark = pytest.mark.e2e

LONG = 4096  # max_model_len of the long-context scenarios (the tiny model's maximum)
TURNS = [
    {"new": prompt(61, 1000), "max_tokens": 300},
    {"new": prompt(62, 200), "max_tokens": 300},
    {"new": prompt(63, 200), "max_tokens": 16},
]


def boundary(tokens: int, block_size: int) -> int:
    return tokens // block_size * block_size


def expected_hits(turns: list[dict[str, Any]], block_size: int) -> list[int]:
    """Turn t+1 can hit at the last block boundary vLLM computed in turn t (its prompt plus all
    but the last generated token), never past its own last prompt token."""
    hits = [0]
    for prev, cur in zip(turns, turns[1:], strict=False):
        computed = prev["prompt_len"] + len(prev["tokens"]) - 1
        hits.append(boundary(min(computed, cur["prompt_len"] - 1), block_size))
    return hits


@pytest.fixture(scope="module")
def reference(granite_model: Path) -> dict[str, Any]:
    args = {"model": str(granite_model), "turns": TURNS, "max_model_len": LONG}
    return run_scenario("conversation", args)


def test_next_turns_hit_through_previous_output_from_the_cpu_tier_by_default(
    granite_model, reference
):
    got = run_scenario(
        "conversation",
        {
            "model": str(granite_model),
            "turns": TURNS,
            "max_model_len": LONG,
            "extra": {"cpu_cache_gb": 0.1},
        },
    )
    bs = got["block_size"]
    turns = got["turns"]
    assert [t["tokens"] for t in turns] == [t["tokens"] for t in reference["turns"]]
    assert [t["cached"] for t in turns] == expected_hits(turns, bs)
    # Deeper than vLLM's default alone could give: the previous prompt's end.
    for prev, cur in zip(turns, turns[1:], strict=False):
        assert cur["cached"] > boundary(prev["prompt_len"] - 1, bs)
    assert got["leaks"]["locked_entries"] == 0 and got["leaks"]["tracked_requests"] == 0


def test_next_turns_hit_through_previous_output_from_storage_in_a_fresh_process(
    granite_model, reference, tmp_path
):
    args = {
        "model": str(granite_model),
        "turns": TURNS,
        "max_model_len": LONG,
        "extra": {"cpu_cache_gb": 0.1, "storage": {"url": f"file://{tmp_path}"}},
    }
    # Process 1 serves turn 1 only: its prompt and its answer are written through to storage.
    run_scenario("conversation", {**args, "turns": TURNS[:1]})
    # Process 2 starts empty and is asked turn 2 directly: its hit reaches into turn 1's
    # answer, which only process 1 computed, so every hit token came from storage.
    ref = reference["turns"]
    turn2 = TURNS[0]["new"] + ref[0]["tokens"] + TURNS[1]["new"]
    read = run_scenario(
        "conversation", {**args, "turns": [{"new": turn2, "max_tokens": TURNS[1]["max_tokens"]}]}
    )
    bs = read["block_size"]
    assert read["turns"][0]["tokens"] == ref[1]["tokens"]
    assert read["turns"][0]["cached"] == expected_hits(ref, bs)[1]
    assert read["turns"][0]["cached"] > boundary(ref[0]["prompt_len"] - 1, bs)
    assert read["stats"]["storage_fetches"] == 1
    assert read["leaks"]["storage_fetches_open"] == 0


def test_prompt_sharing_the_first_3000_of_4000_tokens_hits_at_a_checkpoint(granite_model):
    a = prompt(71, 4000)
    b = a[:3000] + prompt(72, 1000)
    # Mamba states exist only at prefill-chunk ends (and a prompt's last block boundary), on
    # GPUs as on CPU: 512-token chunks put one at every checkpoint.
    common = {"model": str(granite_model), "max_model_len": LONG, "max_num_batched_tokens": 512}
    ref = run_scenario("baseline", {**common, "prompts": [b]})
    got = run_scenario(
        "cpu_tier", {**common, "prompts": [a], "after": [b], "extra": {"cpu_cache_gb": 0.2}}
    )
    assert got["after"][0]["cached"] >= 2048
    assert got["after"][0]["tokens"] == ref["single"][0]["tokens"]
    assert got["leaks"]["locked_entries"] == 0


def test_a_4k_token_generation_leaves_a_handful_of_states_not_one_per_block(granite_model):
    got = run_scenario(
        "host_states",
        {
            "model": str(granite_model),
            "prompts": [prompt(81, 96)],
            "max_tokens": 3990,
            "max_model_len": LONG,
            "extra": {"cpu_cache_gb": 0.2},
        },
    )
    stats, bs = got["stats"], got["block_size"]
    total = 96 + 3990
    boundaries = (total - 1) // bs  # block boundaries the request crossed
    # Prompt end, the checkpoints every 1,024 tokens and the latest decode state.
    assert stats["host_mamba_used"] <= 2 + total // 1024
    assert stats["mamba_states_replaced"] >= boundaries - 2 - total // 1024 - 1
    assert stats["host_mamba_used"] < boundaries / 4


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_storage_write_policies_write_what_they_promise(granite_model, tmp_path, policy):
    popular, once = prompt(91, 1000), prompt(92, 1000)
    storage = {"url": f"file://{tmp_path}", "write_policy": policy}
    # write_back: a CPU tier too small for both prompts, so evictions write back during the run.
    cpu = 0.003 if policy == "write_back" else 0.05
    wrote = run_scenario(
        "write_policy",
        {
            "model": str(granite_model),
            "prompts": [popular, once],
            "repeats": 3,
            "extra": {"cpu_cache_gb": cpu, "storage": storage},
        },
    )
    puts = wrote["puts"]  # after: popular x3 (cold, CPU hit, CPU hit), then `once`
    if policy == "write_through":
        assert puts[0] > 0  # every store, at once
    elif policy == "write_through_selective":
        assert puts[0] == puts[1] == 0  # cold, then its first hit: not popular yet
        assert puts[2] > 0  # the second hit makes it popular
        assert puts[3] == puts[2]  # `once` never gets there
    else:
        assert puts[0] == 0  # nothing until the CPU tier evicts
        assert puts[3] > 0
    read = run_scenario(
        "storage_reader",
        {
            "model": str(granite_model),
            "prompts": [popular, once],
            "extra": {"cpu_cache_gb": 0.05, "storage": storage},
        },
    )
    hit = boundary(999, read["block_size"])
    assert read["outs"][0]["tokens"] == wrote["outs"][0]["tokens"]
    assert read["outs"][1]["tokens"] == wrote["outs"][3]["tokens"]
    # Restart hits wherever the policy promises one (write_back: flushed at clean shutdown).
    want_once = 0 if policy == "write_through_selective" else hit
    assert [o["cached"] for o in read["outs"]] == [hit, want_once]


TAILS = {"cpu_cache_gb": 0.1, "partial_tail_hits": True}


def computed_hits(turns: list[dict[str, Any]]) -> list[int]:
    """Turn t+1 can hit every token vLLM computed in turn t (its prompt plus all but the last
    generated token), never past its own last prompt token: no block rounding."""
    hits = [0]
    for prev, cur in zip(turns, turns[1:], strict=False):
        hits.append(min(prev["prompt_len"] + len(prev["tokens"]) - 1, cur["prompt_len"] - 1))
    return hits


def test_partial_tails_hit_through_the_whole_previous_answer(granite_model, reference):
    """A next turn loads the previous turn's last, partly filled block and the Mamba state after
    its last computed token: the hit ends inside a block, and tokens stay those of an engine
    with no connector. vLLM gets every block it held for the tail's copy back."""
    got = run_scenario(
        "conversation",
        {"model": str(granite_model), "turns": TURNS, "max_model_len": LONG, "extra": TAILS},
    )
    bs, turns, stats = got["block_size"], got["turns"], got["stats"]
    assert [t["tokens"] for t in turns] == [t["tokens"] for t in reference["turns"]]
    want = computed_hits(turns)
    assert [t["cached"] for t in turns] == want
    assert all(w % bs for w in want[1:])  # inside a block: only a tail can give these hits
    assert stats["tail_hits"] == 2 and stats["tails_stored"] == 3
    # The engine went idle after each turn: nothing is left waiting for a copy.
    assert all(t["idle_steps"] < 16 for t in turns)
    leaks = got["leaks"]
    assert leaks["locked_entries"] == leaks["pending_stores"] == leaks["tracked_requests"] == 0
    assert leaks["slots_conserved"]


def test_a_tail_whose_tokens_differ_is_not_hit(granite_model):
    """The previous answer's last tokens edited before the next turn (a client that rewrote
    history): the tail's tokens no longer match, so the hit stops at the last full block that
    does, and tokens are those of an engine with no connector."""
    turns = [TURNS[0], {**TURNS[1], "edit": {}}]
    ref = run_scenario(
        "conversation", {"model": str(granite_model), "turns": TURNS[:1], "max_model_len": LONG}
    )
    computed = len(TURNS[0]["new"]) + len(ref["turns"][0]["tokens"]) - 1
    turns[1]["edit"] = {computed - 2: 7}  # inside the tail, not in its last full block
    args = {"model": str(granite_model), "turns": turns, "max_model_len": LONG}
    want = run_scenario("conversation", args)
    got = run_scenario("conversation", {**args, "extra": TAILS})
    bs = got["block_size"]
    assert [t["tokens"] for t in got["turns"]] == [t["tokens"] for t in want["turns"]]
    assert got["turns"][1]["cached"] == boundary(computed - 2, bs)
    assert got["stats"]["tail_hits"] == 0 and got["stats"]["tails_stored"] == 2


def test_a_fresh_process_hits_the_previous_answers_tail_from_storage(
    granite_model, reference, tmp_path
):
    """Process 1 serves turn 1; its tail goes through the CPU tier to storage with its blocks.
    Process 2 starts empty and is asked turn 2: its probe finds the tail past the stored blocks
    (one name per possible length), fetches page and state, and hits every token turn 1
    computed, token-exact. This is what a replica reading another replica's answer gets."""
    extra = {**TAILS, "storage": {"url": f"file://{tmp_path}"}}
    args = {"model": str(granite_model), "max_model_len": LONG, "extra": extra}
    run_scenario("conversation", {**args, "turns": TURNS[:1]})
    ref = reference["turns"]
    turn2 = TURNS[0]["new"] + ref[0]["tokens"] + TURNS[1]["new"]
    read = run_scenario(
        "conversation", {**args, "turns": [{"new": turn2, "max_tokens": TURNS[1]["max_tokens"]}]}
    )
    got, bs = read["turns"][0], read["block_size"]
    assert got["tokens"] == ref[1]["tokens"]
    assert got["cached"] == computed_hits(ref)[1] and got["cached"] % bs
    assert read["stats"]["storage_tails_seen"] == 1 and read["stats"]["tail_hits"] == 1
    assert read["leaks"]["storage_fetches_open"] == 0 and read["leaks"]["locked_entries"] == 0
