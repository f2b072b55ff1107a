"""Cold prefill on vLLM's CPU build: Mamba2 checkpoints exported (``cpu_compat``) vs dropped.

With the export a prompt whose last chunk crosses a block boundary is computed in one engine
step (the state at its last boundary saved from inside the chunk, as on a GPU); with
``HIMAMBA_CPU_MAMBA2_CHECKPOINTS=0`` the spec promises no checkpoints and vLLM stops the chunk
at that boundary, so the prompt takes a second step. One run alternates the two arms, each
an offline engine (no connector, vLLM's own prefix cache) in a fresh process, on the same
fresh prompts, one request at a time; it reports the median time of a one-token request, the
prefill steps per prompt and whether the arms produced the same tokens.

    python -m benchmarks.bench_cpu_checkpoints [--model big] [--prompt-len 2912] [--requests 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ARMS = {"exported": "1", "dropped": "0"}


def child(args: dict[str, Any]) -> None:
    """One engine: time each prompt's one-token request; print one JSON line."""
    from benchmarks.bench_cpu_tier import MAX_MODEL_LEN
    from tests.harness.offline_engine import generate, make_llm, prompt
    from tests.harness.prefill_steps import record_prefill_chunks

    llm = make_llm({"model": args["model"], "max_model_len": MAX_MODEL_LEN}, None)
    chunks = record_prefill_chunks(llm)
    generate(llm, [prompt(999, args["prompt_len"])], 1)  # warm-up
    rows = []
    for i in range(args["requests"]):
        chunks.clear()
        p = prompt(1000 + i, args["prompt_len"])
        start = time.perf_counter()
        (out,) = generate(llm, [p], 4)
        rows.append(
            {"s": time.perf_counter() - start, "steps": len(chunks), "tokens": out["tokens"]}
        )
    print("RESULT " + json.dumps(rows), flush=True)


def run_arm(arm: str, args: dict[str, Any]) -> list[dict[str, Any]]:
    from tests.harness.subprocess_run import child_env

    env = child_env()
    env.pop("VLLM_PLUGINS", None)
    env["HIMAMBA_CPU_MAMBA2_CHECKPOINTS"] = ARMS[arm]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_cpu_checkpoints", "--child", json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{arm} engine failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="big", help="tiny | big (bench_cpu_tier's models)")
    ap.add_argument("--prompt-len", type=int, default=2912)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two arms")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child))
        return
    from benchmarks.bench_cpu_tier import build_model

    args = {"model": str(build_model(a.model)), "prompt_len": a.prompt_len, "requests": a.requests}
    runs: dict[str, list[list[dict[str, Any]]]] = {arm: [] for arm in ARMS}
    for _ in range(a.rounds):
        for arm in ARMS:
            runs[arm].append(run_arm(arm, args))
    report: dict[str, Any] = {"model": a.model, "prompt_len": a.prompt_len, "arms": {}}
    for arm, rs in runs.items():
        times = [r["s"] for run in rs for r in run]
        report["arms"][arm] = {
            "median_s": round(statistics.median(times), 4),
            "per_round_median_s": [round(statistics.median(r["s"] for r in run), 4) for run in rs],
            "prefill_steps": sorted({r["steps"] for run in rs for r in run}),
        }
    tokens = {arm: [r["tokens"] for r in rs[0]] for arm, rs in runs.items()}
    report["tokens_identical"] = tokens["exported"] == tokens["dropped"]
    report["exported_over_dropped"] = round(
        report["arms"]["exported"]["median_s"] / report["arms"]["dropped"]["median_s"], 3
    )
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
