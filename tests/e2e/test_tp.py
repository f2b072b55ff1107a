"""Tensor parallelism (TP=2, workers in their own processes) end to end on CPU.

Each worker holds its own shard of every block and state, stores it under its own rank's keys
and fetches it back on its own; a storage hit is only real when both ranks fetched. Tokens are
compared with a TP=2 engine that has no connector. Storage here is a 3-node Redis Cluster
(LMCache's cluster client opened by each spawned worker); the other stores are the same code
path below the adapter and are covered at TP=2 by tests/lifecycle/test_tp.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.offline_engine import prompt
from tests.harness.process_faults import delay_acks
from tests.harness.redis_cluster import running_cluster
from tests.harness.subprocess_run import run_scenario

pytestmark = pytest.mark.e2e

PROMPT_LEN = 1000
TP = {"tp": 2}


def hit(block_size: int) -> int:
    return (PROMPT_LEN - 1) // block_size * block_size


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [prompt(41, PROMPT_LEN), prompt(42, PROMPT_LEN)]


@pytest.fixture(scope="module")
def reference(granite_model: Path, prompts: list[list[int]]) -> dict[str, Any]:
    return run_scenario("baseline", {"model": str(granite_model), "prompts": prompts, **TP})


def test_tp2_cpu_tier_hit_after_gpu_reset_is_token_exact(granite_model, prompts, reference):
    got = run_scenario(
        "cpu_tier",
        {
            "model": str(granite_model),
            "prompts": prompts[:1],
            "extra": {"cpu_cache_gb": 0.05},
            **TP,
        },
    )
    rnd, bs = got["rounds"][0], got["block_size"]
    assert rnd["cold"]["tokens"] == reference["single"][0]["tokens"]
    assert rnd["cpu"]["cached"] == hit(bs)
    assert rnd["cpu"]["tokens"] == reference["single"][0]["tokens"]
    assert got["leaks"]["locked_entries"] == 0 and got["leaks"]["inflight_loads"] == 0


@pytest.fixture(scope="module")
def written(granite_model, prompts, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A TP=2 engine computed both prompts with write-through to a Redis Cluster, then exited;
    the cluster keeps running for the readers."""
    with running_cluster(tmp_path_factory.mktemp("tp-cluster")) as cluster:
        args = {
            "model": str(granite_model),
            "prompts": prompts,
            "extra": {"cpu_cache_gb": 0.05, "storage": {"url": cluster.url}},
            **TP,
        }
        run_scenario("storage_writer", args)
        yield args


def test_tp2_fresh_process_hits_what_another_tp2_process_stored(written, reference):
    read = run_scenario("storage_reader", {**written, "prompts": written["prompts"][:1]})
    bs = read["block_size"]
    assert read["outs"][0]["cached"] == hit(bs)
    assert read["outs"][0]["tokens"] == reference["single"][0]["tokens"]
    assert read["stats"]["storage_fetched"] >= hit(bs) // bs
    assert read["stats"].get("storage_fetch_failed", 0) == 0
    assert read["leaks"]["storage_fetches_open"] == 0 and read["leaks"]["locked_entries"] == 0


def test_tp2_fetch_whose_ranks_finish_in_different_steps_is_a_correct_hit(written, reference):
    # Rank 1 reports every fetch 3 engine steps after rank 0 did. vLLM merges worker metadata
    # per step only; the hit must wait for both ranks, never complete on one rank's bytes.
    read = run_scenario(
        "storage_reader",
        {**written, "prompts": written["prompts"][1:]},
        faults=delay_acks(rank=1, steps=3),
    )
    bs = read["block_size"]
    assert read["outs"][0]["cached"] == hit(bs)
    assert read["outs"][0]["tokens"] == reference["single"][1]["tokens"]
    assert read["stats"].get("storage_fetch_failed", 0) == 0
    assert read["stats"]["storage_fetches"] == 1 and read["stats"]["storage_fetched"] > 0
    # The fault took effect: the fetch's acknowledgements really arrived in different steps.
    assert read["stats"]["fetch_fetches_acked_across_steps"] == 1
    assert read["leaks"]["storage_fetches_open"] == 0


def test_tp2_partial_tail_hit_is_token_exact(granite_model):
    """Each rank copies its shard of the finished turn's partial block and final state (in the
    next step's first hook, before vLLM can reuse the freed blocks); the next turn hits
    through every computed token only once both ranks reported the copy."""
    turns = [
        {"new": prompt(43, PROMPT_LEN), "max_tokens": 40},
        {"new": prompt(44, 100), "max_tokens": 8},
    ]
    args = {"model": str(granite_model), "turns": turns, **TP}
    ref = run_scenario("conversation", args)
    got = run_scenario(
        "conversation", {**args, "extra": {"cpu_cache_gb": 0.05, "partial_tail_hits": True}}
    )
    bs = got["block_size"]
    assert [t["tokens"] for t in got["turns"]] == [t["tokens"] for t in ref["turns"]]
    computed = PROMPT_LEN + 40 - 1
    assert computed % bs and got["turns"][1]["cached"] == computed
    assert got["stats"]["tail_hits"] == 1
    assert all(t["idle_steps"] < 16 for t in got["turns"])
    assert got["leaks"]["locked_entries"] == 0 and got["leaks"]["pending_stores"] == 0
