"""One vLLM OpenAI server process on 127.0.0.1, as users run it (multi-process engine).

Shared by the server tests and the benchmarks that drive a server: start it in its own process
group, wait for /health, and stop the whole group (SIGINT, then SIGKILL) however the caller
exits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(
    model: Path, port: int, kv_config: dict[str, Any] | None, *extra: str
) -> list[str]:
    """The tests' server: the tiny model as ``tiny``, float32, prefix caching on."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--max-num-seqs", "4", "--enable-prefix-caching",
    ]  # fmt: skip
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    return cmd + list(extra)


@contextmanager
def running_server(
    model: Path,
    kv_config: dict[str, Any] | None,
    log: Path,
    *extra_args: str,
    env: dict[str, str] | None = None,
    ready_s: float = 300,
) -> Iterator[str]:
    """Yield the base URL of a ready server; it is stopped when the block exits."""
    port = free_port()
    full_env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache, /collective_rpc
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        **(env or {}),
    }
    with open(log, "w") as out:
        proc = subprocess.Popen(
            server_command(model, port, kv_config, *extra_args),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + ready_s
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited early:\n{log.read_text()[-5000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                raise AssertionError(f"server not ready in {ready_s} s:\n{log.read_text()[-5000:]}")
            time.sleep(1)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def complete(base: str, ids: list[int]) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": ids,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    resp = requests.post(f"{base}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return list(resp.json()["choices"][0]["token_ids"])
