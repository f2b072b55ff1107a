"""Time to first token of *cold* requests on the OpenAI server: storage configured or not.

A cold request (nothing cached anywhere) must not pay for the storage tier being configured:
no extra engine step, no waiting on a probe that finds nothing. One run starts the server three
times on 127.0.0.1 (no connector; himamba with the CPU tier; himamba with the CPU tier and a
directory store) and sends the same sequence of fresh prompts to each, one at a time, streaming,
timing the first streamed token. Servers run one after another, each with the same warm-up.

    python benchmarks/bench_cold_ttft.py [--requests 30] [--prompt-len 1000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

from scenarios import prompt  # noqa: E402
from tiny_models import DEFAULT_CACHE_DIR, build_granite_hybrid  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, kv_config: dict[str, Any] | None, log: Path) -> tuple[Any, str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--max-num-seqs", "4", "--enable-prefix-caching",
    ]  # fmt: skip
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "HF_HUB_OFFLINE": "1",
    }
    out = open(log, "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except requests.RequestException:
            pass
        time.sleep(1)
    raise RuntimeError("server not ready in 300 s")


def stop_server(proc: Any) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


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
    }
    warm = [prompt(10_000 + i, a.prompt_len) for i in range(3)]
    cold = [prompt(20_000 + i, a.prompt_len) for i in range(a.requests)]
    results: dict[str, Any] = {}
    for name, kv in configs.items():
        proc, base = start_server(model, kv, work / f"{name}.log")
        try:
            for ids in warm:
                ttft(base, ids)
            times = [ttft(base, ids) for ids in cold]
        finally:
            stop_server(proc)
        results[name] = {
            "median_s": statistics.median(times),
            "mean_s": statistics.fmean(times),
            "p90_s": sorted(times)[int(0.9 * (len(times) - 1))],
        }
        print(f"{name:<18} median TTFT {results[name]['median_s'] * 1e3:7.1f} ms", flush=True)
    ref = results["cpu_tier"]["median_s"]
    ratio = results["cpu_tier+storage"]["median_s"] / ref
    none = results["cpu_tier"]["median_s"] / results["no_connector"]["median_s"]
    print(f"storage configured / CPU tier only: {ratio:.3f}x (goal <= 1.05x)")
    print(f"CPU tier / no connector:            {none:.3f}x")
    summary = {"requests": a.requests, "prompt_len": a.prompt_len, "results": results,
               "storage_vs_cpu_tier": ratio, "cpu_tier_vs_none": none}  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
