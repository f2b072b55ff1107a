"""Storage tier end to end: prefixes outlive the process, survive outages, reject bad bytes.

Each engine runs in its own process; they share only the storage (a directory or a real
Redis server on 127.0.0.1). Tokens are compared with an engine that has no connector.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.harness.offline_engine import prompt
from tests.harness.redis_server import require_redis_server
from tests.harness.subprocess_run import run_scenario

pytest_plugins = ("tests.harness.redis_server", "tests.harness.s3_server")  # + s3_server
pytestmark = pytest.mark.e2e

A_LEN, B_LEN = 1000, 700


def hit(prompt_len: int, block_size: int) -> int:
    """Deepest hittable boundary: the last prompt token is always recomputed."""
    return (prompt_len - 1) // block_size * block_size


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [prompt(31, A_LEN), prompt(32, B_LEN), prompt(33, A_LEN)]


@pytest.fixture(scope="module")
def baseline_run(granite_model: Path, prompts: list[list[int]]) -> dict[str, Any]:
    return run_scenario("baseline", {"model": str(granite_model), "prompts": prompts})


@pytest.fixture(scope="module")
def reference(baseline_run: dict[str, Any]) -> list[list[int]]:
    return [o["tokens"] for o in baseline_run["single"]]


@pytest.fixture(scope="module")
def block(baseline_run: dict[str, Any]) -> int:
    """The engine's scheduler block size (vLLM derives it at start-up)."""
    return int(baseline_run["block_size"])


def extra(url: str, **storage: Any) -> dict[str, Any]:
    return {"cpu_cache_gb": 0.05, "storage": {"url": url, **storage}}


def test_restarted_engine_hits_prefixes_another_process_wrote_to_disk(
    granite_model, prompts, reference, block, tmp_path
):
    args = {
        "model": str(granite_model),
        "prompts": prompts[:2],
        "extra": extra(f"file://{tmp_path}"),
    }
    wrote = run_scenario("storage_writer", args)
    assert [o["tokens"] for o in wrote["outs"]] == reference[:2]
    assert wrote["worker"]["storage_puts_ok"] > 0
    read = run_scenario("storage_reader", args)
    assert [o["cached"] for o in read["outs"]] == [hit(A_LEN, block), hit(B_LEN, block)]
    assert [o["tokens"] for o in read["outs"]] == reference[:2]
    assert read["stats"]["storage_fetches"] == 2
    assert read["worker"]["storage_gets_ok"] >= hit(A_LEN, block) // block + 1
    assert read["worker"]["storage_gets_in_place"] > 0  # read straight into host slots
    assert read["leaks"]["locked_entries"] == 0 and read["leaks"]["slots_conserved"]


def test_restarted_engine_hits_prefixes_written_to_an_s3_object_store(
    granite_model, prompts, reference, block, s3_server
):
    """The same restart through an S3 API (moto's server, LMCache's s3 adapter): what most
    fleets have for a cold tier. Credentials reach both engines through the environment."""
    args = {"model": str(granite_model), "prompts": prompts[:2], "extra": extra(s3_server.url)}
    wrote = run_scenario("storage_writer", args)
    assert [o["tokens"] for o in wrote["outs"]] == reference[:2]
    assert wrote["worker"]["storage_puts_ok"] > 0
    assert s3_server.object_count() >= wrote["worker"]["storage_puts_ok"]
    read = run_scenario("storage_reader", args)
    assert [o["cached"] for o in read["outs"]] == [hit(A_LEN, block), hit(B_LEN, block)]
    assert [o["tokens"] for o in read["outs"]] == reference[:2]
    assert read["stats"]["storage_fetches"] == 2
    assert read["worker"]["storage_gets_ok"] >= hit(A_LEN, block) // block + 1
    assert read["leaks"]["locked_entries"] == 0 and read["leaks"]["slots_conserved"]


def test_two_engines_sharing_redis_reuse_each_others_prefixes(
    granite_model, prompts, reference, block, redis_server
):
    args = {"model": str(granite_model), "prompts": [prompts[0]], "extra": extra(redis_server.url)}
    run_scenario("storage_writer", args)
    read = run_scenario("storage_reader", {**args, "prompts": [prompts[0]]})
    assert read["outs"][0]["cached"] == hit(A_LEN, block)
    assert read["outs"][0]["tokens"] == reference[0]
    assert read["worker"]["storage_gets_ok"] >= hit(A_LEN, block) // block + 1
    assert read["worker"]["storage_gets_in_place"] > 0


def test_redis_outage_keeps_every_request_correct_and_hits_return_after_restart(
    granite_model, prompts, reference, block, tmp_path
):
    require_redis_server()  # the scenario starts, kills and restarts its own
    args = {
        "model": str(granite_model),
        "prompts": prompts,
        "workdir": str(tmp_path),
        "extra": extra("redis://127.0.0.1:1", breaker_cooldown_s=1.0, probe_interval_s=1.0),
    }
    out = run_scenario("storage_outage", args)
    assert out["before"]["tokens"] == reference[0]
    # Redis down and the CPU tier reset: everything is recomputed, correctly.
    assert [o["tokens"] for o in out["down"]] == reference[:2]
    assert [o["cached"] for o in out["down"]] == [0, 0]
    assert out["after_restart_cold"]["tokens"] == reference[2]
    # After the restart the prefix written since is served from Redis again.
    assert out["after_restart_hit"]["cached"] == hit(A_LEN, block)
    assert out["after_restart_hit"]["tokens"] == reference[2]
    assert out["leaks"]["locked_entries"] == 0


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_corrupted_or_truncated_objects_are_misses_not_garbage(
    granite_model, prompts, reference, tmp_path, damage
):
    args = {
        "model": str(granite_model),
        "prompts": [prompts[0]],
        "extra": extra(f"file://{tmp_path}"),
    }
    run_scenario("storage_writer", args)
    files = sorted(p for p in tmp_path.rglob("*.data") if p.is_file())
    assert files, "write-through left no objects"
    for path in files:
        data = bytearray(path.read_bytes())
        if damage == "corrupt":
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            path.write_bytes(bytes(data[: len(data) // 2]))
    read = run_scenario("storage_reader", args)
    assert read["outs"][0]["tokens"] == reference[0]
    assert read["outs"][0]["cached"] == 0
    assert read["worker"]["storage_gets_failed"] > 0
    assert read["leaks"]["locked_entries"] == 0 and read["leaks"]["slots_conserved"]


def test_prefix_longer_than_the_host_tier_never_waits_forever(
    granite_model, prompts, reference, block, tmp_path
):
    # The reader's CPU tier holds fewer KV blocks than the stored prefix: the prefetch cannot
    # fit, and must neither evict its own prefix nor re-fetch it round after round.
    model, store = str(granite_model), extra(f"file://{tmp_path}")
    run_scenario("storage_writer", {"model": model, "prompts": prompts[:1], "extra": store})
    small = {**store, "cpu_cache_gb": 0.001}  # 3 KV slots; the prefix has 7 blocks
    read = run_scenario(
        "storage_reader", {"model": model, "prompts": prompts[:1], "extra": small}, timeout=300
    )
    assert read["outs"][0]["tokens"] == reference[0]
    assert read["stats"]["host_kv_capacity"] < hit(A_LEN, block) // block
    assert read["stats"]["storage_fetch_no_space"] >= 1
    assert read["stats"].get("storage_fetches", 0) == 0
    leaks = read["leaks"]
    assert leaks["storage_fetches_open"] == 0 and leaks["locked_entries"] == 0
    assert leaks["storage_requests"] == 0 and leaks["slots_conserved"]
