"""A fleet of engines on one Redis Cluster (issue #16): real vLLM CPU engines, a real 3-node
cluster on loopback, tokens compared with an engine that has no connector.

The cluster is reached through LMCache's `valkey` adapter in cluster mode (what a
`redis+cluster://` URL maps to, `tiers/cluster_url.py`). This file is also the script of its
own multi-process scenarios (`python test_cluster.py NAME JSON`), each engine in a fresh
process like tests/harness/scenarios.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness.offline_engine import prompt
from tests.harness.redis_cluster import SKIP_REASON, cluster_available
from tests.harness.subprocess_run import child_env, run_script

pytestmark = [pytest.mark.e2e]
pytest_plugins = ("tests.harness.redis_cluster",)  # redis_cluster

A_LEN, B_LEN = 1000, 700
THIS = ["-m", "tests.e2e.test_cluster"]  # how a child runs one scenario of this file


needs_cluster = pytest.mark.skipif(not cluster_available(), reason=SKIP_REASON)


def hit(prompt_len: int, block_size: int) -> int:
    """Deepest hittable boundary: the last prompt token is always recomputed."""
    return (prompt_len - 1) // block_size * block_size


def cluster_extra(seeds_url: str, **storage: Any) -> dict[str, Any]:
    from himamba.tiers.cluster_url import cluster_adapter_spec

    return {
        "cpu_cache_gb": 0.05,
        "storage": {"adapter": cluster_adapter_spec(seeds_url), **storage},
    }


def run_here(name: str, args: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """One scenario of this file in a fresh interpreter."""
    return run_script(THIS + [name, json.dumps(args)], child_env(), timeout, f"scenario {name}")


# -- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [prompt(41, A_LEN), prompt(42, B_LEN), prompt(43, A_LEN)]


@pytest.fixture(scope="module")
def baseline_run(granite_model: Path, prompts: list[list[int]]) -> dict[str, Any]:
    """One engine with no connector: the long prompts, then the short ones (their length
    depends on the block size this very engine reports)."""
    return run_here("baseline_two_phase", {"model": str(granite_model), "prompts": prompts})


@pytest.fixture(scope="module")
def reference(baseline_run: dict[str, Any]) -> list[list[int]]:
    return [o["tokens"] for o in baseline_run["single"]]


@pytest.fixture(scope="module")
def short_prompts(baseline_run: dict[str, Any]) -> list[list[int]]:
    return baseline_run["short_prompts"]


@pytest.fixture(scope="module")
def short_reference(baseline_run: dict[str, Any]) -> list[list[int]]:
    return [o["tokens"] for o in baseline_run["short"]]


@pytest.fixture(scope="module")
def block(baseline_run: dict[str, Any]) -> int:
    return int(baseline_run["block_size"])


# -- tests ----------------------------------------------------------------------------------
@needs_cluster
def test_fresh_engine_hits_what_an_exited_engine_stored_in_the_cluster(
    granite_model, prompts, reference, block, redis_cluster
):
    from tests.harness.subprocess_run import run_scenario

    args = {"model": str(granite_model), "prompts": prompts[:2]}
    args["extra"] = cluster_extra(redis_cluster.url)
    wrote = run_scenario("storage_writer", args)
    assert [o["tokens"] for o in wrote["outs"]] == reference[:2]
    assert wrote["worker"]["storage_puts_ok"] > 0
    per_node = redis_cluster.keys_per_node()
    assert sum(1 for n in per_node if n > 0) == 3, per_node  # objects spread over every node
    read = run_scenario("storage_reader", args)
    assert [o["cached"] for o in read["outs"]] == [hit(A_LEN, block), hit(B_LEN, block)]
    assert [o["tokens"] for o in read["outs"]] == reference[:2]
    assert read["stats"]["storage_fetches"] == 2
    assert read["leaks"]["locked_entries"] == 0 and read["leaks"]["slots_conserved"]


@needs_cluster
def test_serving_replica_hits_a_prefix_another_live_replica_just_computed(
    granite_model, prompts, reference, block, redis_cluster, tmp_path
):
    common = {
        "model": str(granite_model),
        "extra": cluster_extra(redis_cluster.url),
        "sync": str(tmp_path),
        "shared": prompts[0],
        "warmup": prompts[1],
    }
    # Replica B starts first and serves its own traffic; replica A computes the shared
    # prefix only once B is serving, and B asks for it right after A's write-through landed.
    b = subprocess.Popen(
        [sys.executable, *THIS, "fleet_replica", json.dumps({**common, "role": "b"})],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        a = run_here("fleet_replica", {**common, "role": "a"})
        out, err = b.communicate(timeout=300)
    finally:
        if b.poll() is None:
            b.kill()
            b.wait()
    res = next((json.loads(x[7:]) for x in out.splitlines() if x.startswith("RESULT ")), None)
    assert res is not None, f"replica b failed:\n{out[-2000:]}\n{err[-4000:]}"
    assert a["shared"]["cached"] == 0 and a["shared"]["tokens"] == reference[0]
    assert res["warmup"]["tokens"] == reference[1]
    assert res["waited_s"] < 120
    assert res["shared"]["cached"] == hit(A_LEN, block)
    assert res["shared"]["tokens"] == reference[0]
    assert res["stats"]["storage_fetches"] == 1
    assert res["leaks"]["locked_entries"] == 0


@needs_cluster
def test_one_dead_node_keeps_every_request_exact_and_its_keys_return_after_restart(
    granite_model, short_prompts, short_reference, block, tmp_path
):
    reference = short_reference
    out = run_here(
        "node_outage",
        {
            "model": str(granite_model),
            "prompts": short_prompts,
            "workdir": str(tmp_path),
            # The breaker judges the store as a whole: with one node of three down, most calls
            # fail, and the one-key health probe fails for good when its key lives on the dead
            # node (README "A node down"). Kept out of the way here so the test sees what the
            # live nodes still serve.
            "storage": {"breaker_failures": 1000, "probe_interval_s": 3600.0},
        },
    )
    full = hit(block + 1, block)
    assert [o["tokens"] for o in out["cold"]] == reference
    assert [o["cached"] for o in out["healthy"]] == [full] * len(reference)
    assert [o["tokens"] for o in out["healthy"]] == reference
    # One node of three down: every request completes with the recompute's tokens...
    assert [o["tokens"] for o in out["down"]] == reference
    # ...and what sits on the live nodes keeps hitting.
    assert out["down_hits"] > 0, out["down_stats"]
    assert out["down_hits"] < len(reference), out["down_stats"]
    # The node is back (empty): requests are exact in every round, and once the client has
    # reconnected the rewritten prefixes hit again.
    for r in out["back_rounds"]:
        assert [o["tokens"] for o in r["cold"]] == reference
        assert [o["tokens"] for o in r["back"]] == reference
    assert [o["cached"] for o in out["back"]] == [full] * len(reference)
    assert out["leaks"]["locked_entries"] == 0


# -- scenarios (run in their own processes) -------------------------------------------------
def short_prompt_set(block: int) -> list[list[int]]:
    """One block and a token each: a hit needs one KV object and one Mamba state, so with one
    node of three down some prompts still have both on live nodes."""
    return [prompt(100 + i, block + 1) for i in range(12)]


def baseline_two_phase(args: dict[str, Any]) -> dict[str, Any]:
    from tests.harness.offline_engine import ENGINE, close_llm, generate, make_llm

    llm = make_llm(args, None)
    out: dict[str, Any] = {"single": [generate(llm, [p])[0] for p in args["prompts"]]}
    out["short_prompts"] = short_prompt_set(ENGINE["block_size"])
    out["short"] = [generate(llm, [p])[0] for p in out["short_prompts"]]
    close_llm(llm)
    return out


def fleet_replica(args: dict[str, Any]) -> dict[str, Any]:
    """Replica `a` computes `shared` once `b` is serving; replica `b` serves `warmup`, then
    asks for `shared` as soon as `a` says it is written."""
    from tests.harness.offline_engine import (
        close_llm,
        connectors,
        flush_worker,
        generate,
        leak_report,
        make_llm,
    )

    sync = Path(args["sync"])
    llm = make_llm(args, args["extra"])
    out: dict[str, Any] = {}
    if args["role"] == "b":
        out["warmup"] = generate(llm, [args["warmup"]])[0]
        (sync / "b_serving").touch()
        start = time.monotonic()
        while not (sync / "a_written").exists():
            if time.monotonic() - start > 240:
                raise TimeoutError("replica a never wrote the shared prefix")
            time.sleep(0.05)
        out["waited_s"] = time.monotonic() - start
        out["shared"] = generate(llm, [args["shared"]])[0]
        sched, _ = connectors(llm)
        out["stats"] = sched.stats()
        out["leaks"] = leak_report(llm)
    else:
        start = time.monotonic()
        while not (sync / "b_serving").exists():
            if time.monotonic() - start > 240:
                raise TimeoutError("replica b never started serving")
            time.sleep(0.05)
        out["shared"] = generate(llm, [args["shared"]])[0]
        out["worker"] = flush_worker()
        (sync / "a_written").touch()
    close_llm(llm)
    return out


def node_outage(args: dict[str, Any]) -> dict[str, Any]:
    """Short prompts stored over a 3-node cluster; node 1 is killed (its keys lost), the host
    tier dropped, the prompts served again; node 1 restarted (empty), the prompts served,
    written again, and served from storage once more."""
    from himamba.tiers.cluster_url import cluster_adapter_spec
    from tests.harness.offline_engine import (
        close_llm,
        connectors,
        drop_host_tier,
        flush_worker,
        generate,
        leak_report,
        make_llm,
    )
    from tests.harness.redis_cluster import RedisCluster

    cluster = RedisCluster(Path(args["workdir"]) / "cluster")
    cluster.start()
    try:
        extra = {
            "cpu_cache_gb": 0.05,
            "storage": {"adapter": cluster_adapter_spec(cluster.url), **args["storage"]},
        }
        llm = make_llm(args, extra)
        sched, _ = connectors(llm)
        ps = args["prompts"]

        def serve() -> list[dict[str, Any]]:
            return [generate(llm, [p])[0] for p in ps]

        out: dict[str, Any] = {"cold": serve()}
        flush_worker()
        drop_host_tier(llm)
        out["healthy"] = serve()
        out["keys_per_node"] = cluster.keys_per_node()
        cluster.kill(1)
        drop_host_tier(llm)
        before = sched.stats().get("hit_tokens_storage", 0)
        out["down"] = serve()
        out["down_hits"] = sum(1 for o in out["down"] if o["cached"] > 0)
        out["down_stats"] = {**sched.stats(), "hit_tokens_before": before}
        out["down_worker"] = flush_worker()
        cluster.restart(1)
        # The cluster client reconnects to the node on its own schedule (1-3 s here, longer on
        # a loaded box): until it has, writes to node 1 fail and its prefixes miss again. Each
        # round recomputes what missed, writes it again, and serves everything from storage;
        # every round's tokens must be exact, and within the deadline every prompt must hit.
        out["back_rounds"] = []
        deadline = time.monotonic() + args.get("recover_s", 60.0)
        while True:
            drop_host_tier(llm)
            cold = serve()  # misses on node 1 are recomputed and written again
            flush_worker()
            drop_host_tier(llm)
            out["back"] = serve()
            out["back_rounds"].append({"cold": cold, "back": out["back"]})
            if all(o["cached"] > 0 for o in out["back"]) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        out["stats"] = sched.stats()
        out["worker"] = flush_worker()
        out["leaks"] = leak_report(llm)
        close_llm(llm)
        return out
    finally:
        cluster.stop()


SCENARIOS = {f.__name__: f for f in (baseline_two_phase, fleet_replica, node_outage)}

if __name__ == "__main__":
    from tests.harness.offline_engine import ENGINE

    res = SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))
    res.setdefault("block_size", ENGINE.get("block_size"))
    print("RESULT " + json.dumps(res), flush=True)
