"""Prefill time of a prompt served from the CPU tier vs the same prompt recomputed.

For each hit size N (block aligned), fresh random prompts of N + one block tokens are
generated with ``max_tokens`` (default 1, so the time is prefill / TTFT):

* ``cold``: first time on an engine with the HiMamba connector (full recompute; the
  connector also stores the prompt into its CPU tier),
* ``hit``: after ``llm.reset_prefix_cache()`` (vLLM's own device prefix cache is dropped,
  the CPU tier is not) the same prompt again: its first N tokens are loaded from the CPU
  tier and only the last block is computed. Checked: ``num_cached_tokens == N`` and the
  output tokens equal the cold run's,
* ``nocon``: the same prompts on an engine without any connector (fresh subprocess), to show
  the connector's overhead on a miss.

Each engine runs in its own subprocess (vLLM keeps the worker connector in a process-global
slot). Output: one JSON line per (model, N), then one summary line.

    python -m benchmarks.bench_cpu_tier            # tiny + bigger model, N = 1024, 4096, 5 reps
    python -m benchmarks.bench_cpu_tier --quick    # tiny model only, 3 reps (~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.harness.subprocess_run import child_env

REPO = Path(__file__).resolve().parents[1]
BENCH_MODELS = REPO / ".cache" / "bench-models"
# vLLM sizes a hybrid model's block so one attention page holds one Mamba state page: 128
# tokens for the tests' tiny model, 256 for the "big" variant. The child engine reports it.
MAX_MODEL_LEN = 8192


# -- models ------------------------------------------------------------------------------
def model_config(kind: str) -> dict[str, Any]:
    """The tests' tiny Granite config, or a larger variant; both allow 8k positions."""
    from tests.harness.tiny_models import granite_hybrid_config

    cfg = granite_hybrid_config("float32")
    cfg["max_position_embeddings"] = MAX_MODEL_LEN
    if kind == "tiny":
        return cfg
    if kind != "big":
        raise ValueError(kind)
    n_layers = 8
    cfg.update(
        {
            "hidden_size": 1024,
            "intermediate_size": 2048,
            "shared_intermediate_size": 2048,
            "num_hidden_layers": n_layers,
            # Granite-4.0-H style: mostly Mamba2, one attention layer in four.
            "layer_types": [
                "full_attention" if i % 4 == 3 else "linear_attention" for i in range(n_layers)
            ],
            "num_attention_heads": 16,
            "num_key_value_heads": 8,  # with d_state 64 this gives 256-token blocks
            "attention_multiplier": 0.125,  # 1/sqrt(head_dim=64)
            "mamba_n_heads": 32,
            "mamba_d_head": 64,  # 32 * 64 = expand (2) * hidden (1024)
            "mamba_d_state": 64,
        }
    )
    return cfg


def build_model(kind: str) -> Path:
    from tests.harness.tiny_models import build_model as build

    return build(BENCH_MODELS, f"granite-bench-{kind}-float32", model_config(kind))


# -- one engine (child process) -----------------------------------------------------------
def serve_engine(args: dict[str, Any]) -> None:
    """Start one engine, then run the parent's commands (one JSON line each) on stdin.

    Both engines (with and without the connector) stay up side by side and the parent
    alternates between them, so background load on a shared box hits both alike.
    """
    from tests.harness.offline_engine import close_llm, connectors, generate, make_llm, prompt

    with_connector = args["mode"] == "connector"
    extra = {"cpu_cache_gb": args["cpu_cache_gb"]} if with_connector else None
    t0 = time.perf_counter()
    llm = make_llm(
        {"model": args["model"], "dtype": "float32", "max_model_len": MAX_MODEL_LEN}, extra
    )
    start_s = time.perf_counter() - t0
    mt = args["max_tokens"]
    worker = connectors(llm)[1] if with_connector else None

    def counters() -> dict[str, float]:
        return dict(worker.stats()) if worker is not None else {}

    def delta(before: dict[str, float]) -> dict[str, float]:
        after = counters()
        return {k: round(after[k] - before.get(k, 0), 4) for k in after}

    def one(p: list[int]) -> dict[str, Any]:
        c0 = counters()
        cold = generate(llm, [p], mt)[0]
        row: dict[str, Any] = {"cold_s": cold["s"], "cold_cached": cold["cached"]}
        row["cold_tokens"] = cold["tokens"]
        if with_connector:
            row["cold_worker"] = delta(c0)
            llm.reset_prefix_cache()
            c0 = counters()
            hit = generate(llm, [p], mt)[0]
            row.update(
                hit_worker=delta(c0),
                hit_s=hit["s"],
                hit_cached=hit["cached"],
                same_tokens=hit["tokens"] == cold["tokens"],
            )
        llm.reset_prefix_cache()
        return row

    # Warm-up (not timed): first-call costs (allocations, kernel selection, page faults).
    # The longest prompt once, so its first timed run does not pay first-touch page faults.
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    for seed, n in ((999_001, 2 * bs + 7), (999_002, max(args["sizes"]) + bs)):
        one(prompt(seed, n))
    reply({"ready": True, "engine_start_s": start_s, "block_size": bs})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "run":
            reply(one(prompt(cmd["seed"], cmd["len"])))
        elif cmd["cmd"] == "close":
            stats = connectors(llm)[0].stats() if with_connector else None
            close_llm(llm)
            reply({"stats": stats})
            return


def reply(obj: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


class ChildEngine:
    """Parent-side handle of a benchmark's child engine process (JSON lines over pipes)."""

    def __init__(self, label: str, module: str, args: dict[str, Any], log: Path) -> None:
        self.label = label
        env = child_env()
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--child", json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )

    def wait(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        self.proc.wait()
        raise RuntimeError(
            f"engine {self.label} died (rc={self.proc.returncode}); see {self.log.name}"
        )

    def send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.wait()

    def close(self) -> dict[str, Any]:
        res = self.send({"cmd": "close"})
        self.proc.wait(timeout=120)
        self.log.close()
        return res

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Engine(ChildEngine):
    def __init__(self, args: dict[str, Any]) -> None:
        self.mode = args["mode"]
        super().__init__(
            self.mode, "benchmarks.bench_cpu_tier", args, BENCH_MODELS / f"engine-{self.mode}.log"
        )


# -- parent --------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def summarize(model: str, con: list[dict], base: list[dict] | None) -> list[dict]:
    out = []
    for n in sorted({r["n"] for r in con}):
        rows = [r for r in con if r["n"] == n]
        cold = med([r["cold_s"] for r in rows])
        hit = med([r["hit_s"] for r in rows])
        line: dict[str, Any] = {
            "model": model,
            "n_hit_tokens": n,
            "block_size": rows[0]["block_size"],
            "prompt_tokens": rows[0]["len"],
            "reps": len(rows),
            "recompute_s_median": cold,
            "cpu_hit_s_median": hit,
            "ratio_recompute_over_hit": round(cold / hit, 2),
            "recompute_s_all": [round(r["cold_s"], 4) for r in rows],
            "cpu_hit_s_all": [round(r["hit_s"], 4) for r in rows],
            "store_s_median_on_miss": med([r["cold_worker"]["store_seconds"] for r in rows]),
            "load_s_median_on_hit": med([r["hit_worker"]["load_seconds"] for r in rows]),
            "store_s_median_on_hit": med([r["hit_worker"]["store_seconds"] for r in rows]),
            "bytes_stored_on_miss": rows[0]["cold_worker"]["bytes_stored"],
            "bytes_loaded_on_hit": rows[0]["hit_worker"]["bytes_loaded"],
            "load_avg_1min_range": [min(r["load1"] for r in rows), max(r["load1"] for r in rows)],
            "all_hits_exact": all(r["hit_cached"] == n for r in rows),
            "hit_cached_tokens": sorted({r["hit_cached"] for r in rows}),
            "all_tokens_identical": all(r["same_tokens"] for r in rows),
        }
        if base is not None:
            brows = [r for r in base if r["n"] == n]
            nocon = med([r["cold_s"] for r in brows])
            line["no_connector_s_median"] = nocon
            line["no_connector_s_all"] = [round(r["cold_s"], 4) for r in brows]
            line["miss_overhead_pct"] = round(100 * (cold - nocon) / nocon, 1)
            line["ratio_no_connector_over_hit"] = round(nocon / hit, 2)
            line["cold_tokens_match_no_connector"] = all(
                a["cold_tokens"] == b["cold_tokens"] for a, b in zip(rows, brows, strict=True)
            )
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="~1 min: tiny model only, 3 reps")
    ap.add_argument("--models", default=None, help="comma list of tiny,big")
    ap.add_argument("--sizes", default="1024,4096", help="hit sizes N in tokens (x128)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--cpu-cache-gb", type=float, default=1.0)
    ap.add_argument("--no-baseline", action="store_true", help="skip the no-connector engine")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.child is not None:
        serve_engine(json.loads(a.child))
        return

    models = (a.models or ("tiny" if a.quick else "tiny,big")).split(",")
    reps = a.reps or (3 if a.quick else 5)
    sizes = [int(s) for s in a.sizes.split(",")]
    BENCH_MODELS.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    lines: list[dict[str, Any]] = []
    engines: dict[str, Any] = {}
    for kind in models:
        t = time.perf_counter()
        path = build_model(kind)
        build_s = time.perf_counter() - t
        common = {
            "model": str(path),
            "sizes": sizes,
            "reps": reps,
            "max_tokens": a.max_tokens,
            "cpu_cache_gb": a.cpu_cache_gb,
        }
        con = Engine({**common, "mode": "connector"})
        base = None if a.no_baseline else Engine({**common, "mode": "none"})
        con_ready = con.wait()
        bs = con_ready["block_size"]
        if base is not None:
            base.wait()
        if any(n % bs for n in sizes):
            raise SystemExit(f"{kind}: block size {bs}; --sizes must be multiples of it")
        con_rows: list[dict[str, Any]] = []
        base_rows: list[dict[str, Any]] = []
        for n in sizes:
            for rep in range(reps):
                # N + one block: the last block is always computed, so the hit is exactly N.
                cmd = {"cmd": "run", "seed": 1_000 * n + rep, "len": n + bs}
                # Alternate which engine goes first, so drifting background load evens out.
                order = [con, base] if rep % 2 == 0 else [base, con]
                for eng in order:
                    if eng is None:
                        continue
                    row = {"n": n, "rep": rep, "len": cmd["len"], "block_size": bs}
                    row.update(load1=os.getloadavg()[0], **eng.send(cmd))
                    (con_rows if eng is con else base_rows).append(row)
        closed = con.close()
        if base is not None:
            base.close()
        engines[kind] = {
            "model_build_s": round(build_s, 2),
            "engine_start_s": round(con_ready["engine_start_s"], 2),
            "connector_stats": closed["stats"],
        }
        for line in summarize(kind, con_rows, base_rows if base is not None else None):
            print(json.dumps(line), flush=True)
            lines.append(line)
    summary = {
        "summary": True,
        "max_tokens": a.max_tokens,
        "cpu_cache_gb": a.cpu_cache_gb,
        "ratios": {
            f"{x['model']}/N={x['n_hit_tokens']}": x["ratio_recompute_over_hit"] for x in lines
        },
        "miss_overhead_pct": {
            f"{x['model']}/N={x['n_hit_tokens']}": x.get("miss_overhead_pct") for x in lines
        },
        "all_exact": all(x["all_hits_exact"] and x["all_tokens_identical"] for x in lines),
        "engines": engines,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "nproc": os.cpu_count(),
        "wall_s": round(time.perf_counter() - t_all, 1),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
