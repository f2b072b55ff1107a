"""A fleet of two OpenAI-server replicas behind a round-robin client: private tiers vs one
shared Redis Cluster.

Two replicas of a small hybrid (``--model``) run side by side (each its own
``vllm.entrypoints.openai`` process group). N conversations of R turns share one system
prompt; turn t of conversation c goes to replica (c + t - 1) mod 2, so consecutive turns of a
conversation always land on different replicas (what a load balancer without session affinity
does). Configurations, each with both replicas started fresh:

- ``no_connector``: vLLM alone (the device cache only; the replicas share nothing);
- ``private_cpu``: himamba with a CPU tier per replica (turn t+1 finds turn t only if it comes
  back to the replica that served turn t-1, i.e. up to the end of turn t-1);
- ``shared_cluster``: himamba with the same CPU tier per replica plus storage on a 3-node Redis
  Cluster on loopback (``redis+cluster://`` -> LMCache's ``valkey`` adapter), shared by both replicas:
  turn t+1 hits what the other replica wrote at turn t.

Measured per turn: client TTFT (first streamed token), ``cached_tokens`` from the usage, and
the replicas' ``vllm:himamba_hit_tokens{tier}`` deltas. Tokens must be identical across
configurations (exit status 1 otherwise). Goal: turns >= 2, median TTFT of shared_cluster
<= 0.5x private_cpu.

    python -m benchmarks.bench_fleet --out /tmp/fleet.json --plot /tmp/fleet.png   # ~6 min, 2 cores

``--model big`` runs ``bench_cpu_tier``'s ~90M-parameter hybrid instead of the tiny one (prefill
then dominates TTFT, as in production; ~4-5 min per configuration at 4 x 4 turns here), and
``--think-s`` pauses before each request of a client.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

HERE = Path(__file__).resolve().parent

from benchmarks.multiturn_server import Server, ServerSettings, stop_process_group  # noqa: E402
from benchmarks.multiturn_workload import Workload, stream_completion  # noqa: E402

CONFIGS = ("no_connector", "private_cpu", "shared_cluster")
GOAL = 0.5
REPLICAS = 2


def kv_config(config: str, cluster_url: str | None, a: argparse.Namespace) -> dict | None:
    if config == "no_connector":
        return None
    extra: dict[str, Any] = {"cpu_cache_gb": a.cpu_cache_gb}
    if config == "shared_cluster":
        assert cluster_url is not None
        # What a user writes: the URL (redis+cluster:// -> LMCache's valkey adapter).
        storage = {"url": cluster_url, **json.loads(a.storage_extra)}
        cpu_gb = a.cpu_cache_gb if a.storage_cpu_cache_gb is None else a.storage_cpu_cache_gb
        extra = {"cpu_cache_gb": cpu_gb, "storage": storage}
    extra.update(json.loads(a.connector_extra))
    return {
        "kv_connector": "HiMambaConnector",
        "kv_connector_module_path": "himamba.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def replica_env(replica: int, bind: bool) -> dict[str, str] | None:
    """Replica ``r``'s compute threads on core ``r`` alone (vLLM's CPU thread binding).

    Unbound, each replica's worker runs an OpenMP team as wide as the machine, and two teams
    that spin-wait on the same two cores make every step's time depend on what the other
    replica does (a 128-token step measured 22-600 ms). Bound, each replica owns a core, as
    replicas on their own machines would; their API servers and the store still share.
    """
    if not bind or (os.cpu_count() or 1) < REPLICAS:
        return None
    return {"VLLM_CPU_OMP_THREADS_BIND": str(replica)}


_HIT = re.compile(r'^vllm:himamba_hit_tokens(?:_total)?\{[^}]*tier="(\w+)"[^}]*\} ([0-9.eE+-]+)$')
# Where a turn's TTFT goes: the worker's storage fetches (storage -> CPU tier, submission to
# completion), vLLM's own split of each request's time to its first token into queued (arrival
# to first scheduled: probes, fetches and loads of a connector hit) and prefill, and the time
# between two output tokens (a decode step: what any engine step costs at least).
_TIME_KEYS = {
    "himamba_storage_op_seconds": "fetch",
    "request_queue_time_seconds": "queued",
    "request_prefill_time_seconds": "prefill",
    "inter_token_latency_seconds": "decode_step",
}
_TIMES = re.compile(rf"^vllm:({'|'.join(_TIME_KEYS)})_(sum|count)\{{([^}}]*)\}} ([0-9.eE+-]+)$")


def counters(server: Server) -> dict[str, float]:
    """Hit tokens by tier; ``<part>_s`` / ``<part>_n`` for the parts of ``_TIME_KEYS``."""
    text = requests.get(f"{server.base}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := _HIT.match(line):
            key, value = m.group(1), m.group(2)
        elif m := _TIMES.match(line):
            if m.group(1) == "himamba_storage_op_seconds" and 'op="fetch"' not in m.group(3):
                continue
            part = _TIME_KEYS[m.group(1)]
            key, value = f"{part}_s" if m.group(2) == "sum" else f"{part}_n", m.group(4)
        else:
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


def run_config(
    config: str, servers: list[Server], w: Workload, a: argparse.Namespace
) -> dict[str, Any]:
    """Every conversation, turn by turn (all conversations finish turn t before turn t+1)."""
    records: list[dict[str, Any]] = []
    per_turn: list[dict[str, float]] = []
    lock = threading.Lock()
    history = {c: w.system_prompt() for c in range(w.conversations)}

    def snapshot() -> dict[str, float]:
        total: dict[str, float] = {}
        for s in servers:
            for k, v in counters(s).items():
                total[k] = total.get(k, 0.0) + v
        return total

    before = snapshot()
    for turn in range(1, w.turns + 1):

        def client(idx: int, turn: int = turn) -> None:
            with requests.Session() as session:
                for c in range(w.conversations):
                    if w.owner(c) != idx:
                        continue
                    replica = (c + turn - 1) % len(servers)
                    if a.think_s:
                        time.sleep(a.think_s)  # the user reads the answer, then types
                    prompt = history[c] + w.user_message(c, turn)
                    out = stream_completion(session, servers[replica].base, prompt, w.output_tokens)
                    history[c] = prompt + out["tokens"]
                    with lock:
                        records.append(
                            {
                                "config": config,
                                "conversation": c,
                                "turn": turn,
                                "replica": replica,
                                "prompt_tokens": len(prompt),
                                "ttft_s": out["ttft_s"],
                                "cached_tokens": out["cached_tokens"],
                                "tokens": out["tokens"],
                            }
                        )

        threads = [threading.Thread(target=client, args=(i,)) for i in range(w.clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if a.settle_s:
            time.sleep(a.settle_s)  # write-through lands before the next turn asks for it
        after = snapshot()
        per_turn.append({k: after.get(k, 0.0) - before.get(k, 0.0) for k in after})
        before = after
    records.sort(key=lambda r: (r["turn"], r["conversation"]))
    return {"records": records, "counters_per_turn": per_turn}


def _turn_counters(c: dict[str, float]) -> dict[str, Any]:
    """One turn's hit tokens by tier, its storage fetches (count) and the mean time of each
    part of ``_TIME_KEYS`` (ms)."""
    parts = {p: (c.get(f"{p}_s", 0.0), c.get(f"{p}_n", 0.0)) for p in _TIME_KEYS.values()}
    return {
        "tier_hits": {k: v for k, v in c.items() if not k.endswith(("_s", "_n"))},
        "fetches": int(parts["fetch"][1]),
        **{f"{p}_mean_ms": round(1000 * s / n, 1) if n else None for p, (s, n) in parts.items()},
    }


def summarize(results: dict[str, Any], turns: int) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for config, res in results.items():
        rows = {}
        for t in range(1, turns + 1):
            recs = [r for r in res["records"] if r["turn"] == t]
            if not recs:
                continue
            rows[t] = {
                "ttft_median_s": round(statistics.median(r["ttft_s"] for r in recs), 4),
                "ttft_max_s": round(max(r["ttft_s"] for r in recs), 4),
                "cached_median": statistics.median(r["cached_tokens"] or 0 for r in recs),
                "prompt_median": statistics.median(r["prompt_tokens"] for r in recs),
                **_turn_counters(res["counters_per_turn"][t - 1]),
            }
        later = [r["ttft_s"] for r in res["records"] if r["turn"] >= 2]
        table[config] = {
            "per_turn": rows,
            "ttft_median_turns_ge2_s": round(statistics.median(later), 4) if later else None,
        }
    ratio = None
    if "shared_cluster" in table and "private_cpu" in table:
        s, p = (table[k]["ttft_median_turns_ge2_s"] for k in ("shared_cluster", "private_cpu"))
        ratio = round(s / p, 3) if s and p else None
    ref_name = next(iter(results))
    ref = {(r["conversation"], r["turn"]): r["tokens"] for r in results[ref_name]["records"]}
    mismatches = [
        {"config": k, "conversation": r["conversation"], "turn": r["turn"]}
        for k, res in results.items()
        for r in res["records"]
        if ref.get((r["conversation"], r["turn"])) != r["tokens"]
    ]
    return {
        "table": table,
        "shared_vs_private_ttft_ratio_turns_ge2": ratio,
        "goal": GOAL,
        "goal_met": ratio is not None and ratio <= GOAL,
        "token_mismatches": mismatches,
        "tokens_identical": not mismatches,
    }


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for config, row in summary["table"].items():
        turns = sorted(int(t) for t in row["per_turn"])
        ax.plot(
            turns,
            [row["per_turn"][t]["ttft_median_s"] * 1e3 for t in turns],
            marker="o",
            label=config,
        )
    ax.set_xticks(sorted({int(t) for row in summary["table"].values() for t in row["per_turn"]}))
    ax.set_xlabel("turn (consecutive turns on different replicas)")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_title(f"2 replicas, round-robin; shared/private (turns>=2) = "
                 f"{summary['shared_vs_private_ttft_ratio_turns_ge2']}")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--first-user-tokens", type=int, default=1024)
    ap.add_argument("--user-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--cpu-cache-gb", type=float, default=0.25)
    ap.add_argument(
        "--storage-cpu-cache-gb",
        type=float,
        default=None,
        help="shared_cluster's CPU tier (default: --cpu-cache-gb, the private replicas' own: "
        "the question is what a shared store adds to the tiers a replica already has)",
    )
    ap.add_argument(
        "--model",
        default="tiny",
        help="tiny | big (bench_cpu_tier's ~90M-param hybrid, where a prefill costs what a "
        "hit saves in production) or a checkpoint folder",
    )
    ap.add_argument("--device-blocks", type=int, default=0, help="0: 2 max-length requests")
    ap.add_argument("--settle-s", type=float, default=0.5, help="pause between turns")
    ap.add_argument(
        "--think-s",
        type=float,
        default=0.0,
        help="pause before each request of a client (a user's think time). On a box where "
        "the replicas share cores, >= 1 s keeps one replica's post-request busy-wait (vLLM "
        "spins 1 s on its message queues) out of the next request's storage I/O",
    )
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--storage-extra", default="{}", help="JSON merged into shared_cluster's storage config"
    )
    ap.add_argument(
        "--connector-extra",
        default="{}",
        help="JSON merged into every connector config, e.g. '{\"partial_tail_hits\": true}'",
    )
    ap.add_argument(
        "--bind-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replica r computes on core r alone (as replicas on their own machines would)",
    )
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args(argv)
    from benchmarks.bench_multiturn import device_blocks_for, model_path
    from tests.harness.redis_cluster import RedisCluster

    w = Workload(
        a.conversations,
        a.turns,
        a.clients,
        a.system_tokens,
        a.first_user_tokens,
        a.user_tokens,
        a.output_tokens,
        a.seed,
    )
    model, (bs, extra_blocks) = model_path(a.model)
    max_len = bs * math.ceil((w.final_prompt_tokens() + w.output_tokens + 8) / bs)
    # Enough device blocks for the requests in flight, not for every conversation: a later
    # turn can only hit through a connector tier (the guessed block size, + the Mamba groups'
    # blocks per request).
    blocks = a.device_blocks or device_blocks_for(w.clients, max_len // bs + extra_blocks)
    settings = ServerSettings(model, max_len, w.clients, blocks)
    work = a.workdir or Path(tempfile.mkdtemp(prefix="bench_fleet_"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    meta: dict[str, Any] = {
        "workload": w.__dict__,
        "model": a.model,
        "device_blocks": blocks,
        "max_len": max_len,
    }
    for config in a.configs.split(","):
        cluster = None
        servers: list[Server] = []
        try:
            if config == "shared_cluster":
                shutil.rmtree(work / "cluster", ignore_errors=True)
                cluster = RedisCluster(work / "cluster")
                cluster.start()
            kv = kv_config(config, cluster.url if cluster else None, a)
            for r in range(REPLICAS):  # one at a time: two start-ups at once starve 2 cores
                log = work / f"{config}-r{r}.log"
                servers.append(Server.start(settings, kv, log, replica_env(r, a.bind_cores)))
            info = servers[0].cache_info()
            meta.setdefault("block_size", info.get("block_size"))
            for s in servers:  # first-call costs off the clock; shares no prefix
                with requests.Session() as sess:
                    stream_completion(sess, s.base, list(range(3, 3 + 130)), 2)
            t0 = time.perf_counter()
            results[config] = run_config(config, servers, w, a)
            results[config]["wall_s"] = round(time.perf_counter() - t0, 2)
            if cluster is not None:
                results[config]["keys_per_node"] = cluster.keys_per_node()
            print(f"{config}: done in {results[config]['wall_s']} s", file=sys.stderr)
        finally:
            for s in servers:
                stop_process_group(s.proc)
            if cluster is not None:
                cluster.stop()
    summary = summarize(results, w.turns)
    out = {"meta": meta, "summary": summary, "results": results}
    print(json.dumps({"meta": meta, **summary}, indent=1))
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    if a.plot:
        try:
            plot(summary, a.plot)
        except ImportError:
            print("no matplotlib: pip install 'himamba[bench]'", file=sys.stderr)
    return 0 if summary["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
