"""What the connector costs on the critical path of steps that get no hit (issue 9).

Two engines side by side (child processes, the same model): one with the HiMamba connector
(CPU tier, default settings: retention at every block, so decode crosses block boundaries and
stores KV blocks and Mamba states), one without any connector. The parent alternates them.

* ``decode``: 8 fresh prompts (2 blocks + 17 tokens) are admitted, then the engine is stepped
  one ``step()`` at a time; every step after the last prefill is a decode step of the 8-request
  batch. Reported: mean and median step time (the mean includes the steps that store).
* ``miss``: one fresh prompt of ``--miss-tokens`` tokens, ``max_tokens=1`` (prefill of a miss;
  the connector stores all of it into its CPU tier in the same steps).

    python -m benchmarks.bench_step_overhead                 # "big" model, 5 reps (~4 min here)
    python -m benchmarks.bench_step_overhead --model tiny --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from benchmarks.bench_cpu_tier import BENCH_MODELS, MAX_MODEL_LEN, ChildEngine, build_model  # noqa: E402


def decode_steps(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Step the engine by hand; time each step once all prompts are past their prefill."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, sp)
    produced: dict[str, int] = {}
    times: list[float] = []
    while engine.has_unfinished_requests():
        decoding = len(produced) == len(prompts) and all(n >= 1 for n in produced.values())
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        for o in outs:
            produced[o.request_id] = len(o.outputs[0].token_ids)
        if decoding and len(outs) == len(prompts):
            times.append(dt)
    return {
        "steps": len(times),
        "mean_s": statistics.fmean(times),
        "median_s": statistics.median(times),
    }


def serve_engine(args: dict[str, Any]) -> None:
    from tests.harness.offline_engine import close_llm, connectors, generate, make_llm, prompt

    with_connector = args["mode"] == "connector"
    extra = {"cpu_cache_gb": args["cpu_cache_gb"]} if with_connector else None
    llm = make_llm(
        {"model": args["model"], "dtype": "float32", "max_model_len": MAX_MODEL_LEN}, extra
    )
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    worker = connectors(llm)[1] if with_connector else None
    # Warm-up: one of each, not timed.
    decode_steps(llm, [prompt(990_000 + i, 2 * bs + 17) for i in range(8)], 8)
    generate(llm, [prompt(990_100, args["miss_tokens"])], 1)
    reply({"ready": True, "block_size": bs})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "decode":
            ps = [prompt(cmd["seed"] + i, 2 * bs + 17) for i in range(8)]
            reply(decode_steps(llm, ps, cmd["max_tokens"]))
        elif cmd["cmd"] == "miss":
            out = generate(llm, [prompt(cmd["seed"], args["miss_tokens"])], 1)[0]
            reply({"s": out["s"], "cached": out["cached"]})
        elif cmd["cmd"] == "close":
            stats = dict(worker.stats()) if worker is not None else None
            close_llm(llm)
            reply({"worker": stats})
            return


def reply(obj: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="big", choices=["tiny", "big"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=600)
    ap.add_argument("--miss-tokens", type=int, default=4096)
    ap.add_argument("--cpu-cache-gb", type=float, default=1.0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        serve_engine(json.loads(a.child))
        return
    BENCH_MODELS.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    common = {
        "model": str(build_model(a.model)),
        "miss_tokens": a.miss_tokens,
        "cpu_cache_gb": a.cpu_cache_gb,
    }
    engines = {
        mode: ChildEngine(
            mode,
            "benchmarks.bench_step_overhead",
            {**common, "mode": mode},
            BENCH_MODELS / f"step-{mode}.log",
        )
        for mode in ("connector", "none")
    }
    bs = [e.wait() for e in engines.values()][0]["block_size"]
    rows: dict[str, dict[str, list[float]]] = {
        m: {"decode_mean": [], "decode_median": [], "miss": []} for m in engines
    }
    try:
        for rep in range(a.reps):
            order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
            for mode in order:
                d = engines[mode].send(
                    {"cmd": "decode", "seed": 10_000 * (rep + 1), "max_tokens": a.decode_tokens}
                )
                m = engines[mode].send({"cmd": "miss", "seed": 20_000 * (rep + 1)})
                assert m["cached"] == 0, "a miss must not hit"
                rows[mode]["decode_mean"].append(d["mean_s"])
                rows[mode]["decode_median"].append(d["median_s"])
                rows[mode]["miss"].append(m["s"])
        closed = {mode: e.close() for mode, e in engines.items()}
    finally:
        for e in engines.values():
            e.kill()
    med = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in rows.items()}
    out = {
        "model": a.model,
        "block_size": bs,
        "reps": a.reps,
        "decode_tokens": a.decode_tokens,
        "miss_tokens": a.miss_tokens,
        "decode_step_mean_ms": {m: round(1e3 * v["decode_mean"], 3) for m, v in med.items()},
        "decode_step_median_ms": {m: round(1e3 * v["decode_median"], 3) for m, v in med.items()},
        "miss_prefill_s": {m: round(v["miss"], 4) for m, v in med.items()},
        "ratio_decode_step_mean": round(
            med["connector"]["decode_mean"] / med["none"]["decode_mean"], 3
        ),
        "ratio_decode_step_median": round(
            med["connector"]["decode_median"] / med["none"]["decode_median"], 3
        ),
        "ratio_miss_prefill": round(med["connector"]["miss"] / med["none"]["miss"], 3),
        "connector_bytes_stored": (closed["connector"]["worker"] or {}).get("bytes_stored"),
        "connector_store_seconds": (closed["connector"]["worker"] or {}).get("store_seconds"),
        "connector_copy_rows_per_call": round(
            (closed["connector"]["worker"] or {}).get("copy_rows", 0)
            / max(1, (closed["connector"]["worker"] or {}).get("copy_calls", 0)),
            2,
        ),
        "load_avg_1min": os.getloadavg()[0],
        "wall_s": round(time.perf_counter() - t_all, 1),
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
