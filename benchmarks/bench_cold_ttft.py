"""Time to first token of *cold* requests on the OpenAI server: storage configured or not.

A cold request (nothing cached anywhere) must not pay for the storage tier being configured:
no extra engine step, no waiting on a probe that finds nothing. One run starts the server four
times on 127.0.0.1 (no connector; himamba with the CPU tier; himamba with the CPU tier and a
directory store; the same with the store's threads at the engine's priority) and sends the same sequence of fresh prompts to each, one at a time, streaming,
timing the first streamed token. Servers run one after another, each with the same warm-up.

    python -m benchmarks.bench_cold_ttft [--requests 30] [--prompt-len 1000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from tests.harness.offline_engine import prompt
from tests.harness.openai_server import running_server
from tests.harness.tiny_models import DEFAULT_CACHE_DIR, build_granite_hybrid


def ttft(base: str, ids: list[int]) -> float:
    body = {
        "model": "tiny", "prompt": ids, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    start = time.perf_counter()
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                return time.perf_counter() - start
    raise RuntimeError("no token streamed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument(
        "--repeat", type=int, default=2, help="serve the configurations this many times in turn"
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model = build_granite_hybrid(DEFAULT_CACHE_DIR)
    work = Path(tempfile.mkdtemp(prefix="himamba-ttft-"))
    base_kv = {
        "kv_connector": "HiMambaConnector",
        "kv_connector_module_path": "himamba.connector",
        "kv_role": "kv_both",
    }
    configs: dict[str, dict[str, Any] | None] = {
        "no_connector": None,
        "cpu_tier": {**base_kv, "kv_connector_extra_config": {"cpu_cache_gb": 0.05}},
        "cpu_tier+storage": {
            **base_kv,
            "kv_connector_extra_config": {
                "cpu_cache_gb": 0.05,
                "storage": {"url": f"file://{work / 'store'}"},
            },
        },
        # The same with the store's threads at the engine's priority (thread_nice's effect).
        "cpu_tier+storage_nice0": {
            **base_kv,
            "kv_connector_extra_config": {
                "cpu_cache_gb": 0.05,
                "storage": {"url": f"file://{work / 'store0'}", "thread_nice": 0},
            },
        },
    }
    warm = [prompt(10_000 + i, a.prompt_len) for i in range(3)]
    times: dict[str, list[float]] = {name: [] for name in configs}
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    for rep in range(a.repeat):  # A B C D A B C D: drift on a shared box hits every config alike
        cold = [prompt(20_000 + 1000 * rep + i, a.prompt_len) for i in range(a.requests)]
        for name, kv in configs.items():
            with running_server(model, kv, work / f"{name}-{rep}.log", env=env) as base:
                for ids in warm:
                    ttft(base, ids)
                times[name] += [ttft(base, ids) for ids in cold]
    results: dict[str, Any] = {}
    for name, ts in times.items():
        results[name] = {
            "median_s": statistics.median(ts),
            "mean_s": statistics.fmean(ts),
            "p90_s": sorted(ts)[int(0.9 * (len(ts) - 1))],
        }
        print(f"{name:<18} median TTFT {results[name]['median_s'] * 1e3:7.1f} ms", flush=True)
    ref = results["cpu_tier"]["median_s"]
    ratio = results["cpu_tier+storage"]["median_s"] / ref
    none = results["cpu_tier"]["median_s"] / results["no_connector"]["median_s"]
    print(f"storage configured / CPU tier only: {ratio:.3f}x (goal <= 1.05x)")
    nice0 = results["cpu_tier+storage_nice0"]["median_s"] / ref
    print(f"CPU tier / no connector:            {none:.3f}x")
    print(f"storage, thread_nice 0 / CPU tier:  {nice0:.3f}x")
    summary = {"requests": a.requests, "repeat": a.repeat, "prompt_len": a.prompt_len,
               "results": results, "storage_vs_cpu_tier": ratio, "cpu_tier_vs_none": none,
               "storage_nice0_vs_cpu_tier": nice0}  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
