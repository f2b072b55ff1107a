"""One OpenAI server per benchmark configuration: what it is started with, and what it reports.

The multi-turn benchmark judges the connector as users run it: ``vllm.entrypoints.openai``
on 127.0.0.1, multi-process engine (scheduler half in the engine core, worker half in the
worker). Everything the benchmark learns from the server (prefix-cache counters, the block size
vLLM resolved at start-up, why a configuration refused to start) is read here, so the workload
and the report never parse logs or Prometheus text themselves.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import requests

SERVED_NAME = "bench"
READY_TIMEOUT_S = 420.0


class ConfigKind(Enum):
    """The configurations one run compares, in the order they are served."""

    NO_CONNECTOR = "no_connector"
    HIMAMBA_CPU = "himamba_cpu"
    HIMAMBA_CPU_STORAGE = "himamba_cpu+storage"
    NATIVE_OFFLOAD = "native_offload"
    # Native with the knobs that suit conversations: decode blocks offloaded too
    # (offload_prompt_only false) and Mamba/sliding-window checkpoints retained every block
    # (--prefix-cache-retention-interval = the resolved block size).
    NATIVE_OFFLOAD_DECODE_RETAIN = "native_offload+decode+retain"


NATIVE_KINDS = frozenset({ConfigKind.NATIVE_OFFLOAD, ConfigKind.NATIVE_OFFLOAD_DECODE_RETAIN})
# vLLM 0.32's CPU offloading spec refuses to start on the CPU platform (its transfer worker is
# CUDA/XPU only); this benchmark-only spec keeps the native scheduler side and copies blocks with
# plain tensor ops (benchmarks/native_offload_cpu.py). Named here so the client never imports vLLM.
NATIVE_CPU_SPEC = {
    "spec_name": "CPUCopyOffloadingSpec",
    "spec_module_path": "benchmarks.native_offload_cpu",
}
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ServerSettings:
    """What every configuration shares, so only the KV connector differs between servers."""

    model: Path
    max_model_len: int
    max_num_seqs: int
    device_blocks: int
    engine_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ConnectorSettings:
    """Connector sizes and pass-through options (the benchmark does not tune the connector)."""

    cpu_cache_gb: float
    storage_cpu_cache_gb: float
    storage_dir: Path
    extra_config: dict[str, Any] = field(default_factory=dict)


def kv_transfer_config(kind: ConfigKind, c: ConnectorSettings) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of one configuration (None: no connector)."""
    if kind is ConfigKind.NO_CONNECTOR:
        return None
    if kind in NATIVE_KINDS:
        native: dict[str, Any] = {
            **NATIVE_CPU_SPEC,
            "cpu_bytes_to_use": int(c.cpu_cache_gb * 2**30),
        }
        if kind is ConfigKind.NATIVE_OFFLOAD_DECODE_RETAIN:
            native["offload_prompt_only"] = False
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": native,
        }
    extra: dict[str, Any] = {"cpu_cache_gb": c.cpu_cache_gb}
    if kind is ConfigKind.HIMAMBA_CPU_STORAGE:
        extra = {
            "cpu_cache_gb": c.storage_cpu_cache_gb,
            "storage": {"url": f"file://{c.storage_dir}"},
        }
    for key, value in c.extra_config.items():
        if isinstance(value, dict) and isinstance(extra.get(key), dict):
            extra[key] = {**extra[key], **value}
        else:
            extra[key] = value
    return {
        "kv_connector": "HiMambaConnector",
        "kv_connector_module_path": "himamba.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def config_engine_args(kind: ConfigKind, block_size: int) -> tuple[str, ...]:
    """Server arguments one configuration adds to the shared ones (``block_size``: the block
    size vLLM resolved, or the guess before any server ran)."""
    if kind is ConfigKind.NATIVE_OFFLOAD_DECODE_RETAIN:
        return (f"--prefix-cache-retention-interval={block_size}",)
    return ()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerExited(RuntimeError):
    """The server process ended before it answered ``/health``; ``reason`` is its own words."""

    def __init__(self, reason: str, log: Path) -> None:
        super().__init__(f"{reason} (log: {log})")
        self.reason = reason
        self.log = log


@dataclass
class Server:
    """A running server: its process group, base URL and log."""

    proc: subprocess.Popen[bytes]
    base: str
    log: Path
    startup_s: float

    @classmethod
    def start(
        cls,
        s: ServerSettings,
        kv: dict[str, Any] | None,
        log: Path,
        env_extra: dict[str, str] | None = None,
    ) -> Server:
        port = free_port()
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(s.model), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--seed", "0",
            "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
            "--enable-prefix-caching", "--num-gpu-blocks-override", str(s.device_blocks),
            # cached_tokens in the usage of every response, and the server's own TTFT.
            "--enable-prompt-tokens-details", "--enable-per-request-metrics",
            *s.engine_args,
        ]  # fmt: skip
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            # The device cache is sized by --num-gpu-blocks-override; this only has to be
            # large enough for it (GiB, integers only on CPU).
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            # The native configurations load their offloading spec from benchmarks/.
            "PYTHONPATH": os.pathsep.join(
                x for x in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if x
            ),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **(env_extra or {}),
        }
        t0 = time.perf_counter()
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + READY_TIMEOUT_S
        while time.time() < deadline:
            if proc.poll() is not None:
                cause = root_cause(log.read_text(errors="replace"))
                raise ServerExited(cause or "exited before ready (no exception in the log)", log)
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    return cls(proc, base, log, time.perf_counter() - t0)
            except requests.RequestException:
                pass
            time.sleep(1)
        stop_process_group(proc)
        raise ServerExited(f"not ready in {READY_TIMEOUT_S:.0f} s", log)

    def stop(self) -> None:
        stop_process_group(self.proc)

    def metrics(self) -> PrefixCounters:
        return PrefixCounters.parse(requests.get(f"{self.base}/metrics", timeout=30).text)

    def cache_info(self) -> dict[str, str]:
        """Labels of ``vllm:cache_config_info``: what vLLM resolved (block size, blocks, ...)."""
        text = requests.get(f"{self.base}/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith("vllm:cache_config_info{"):
                return dict(re.findall(r'(\w+)="([^"]*)"', line))
        return {}


def stop_process_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT (clean shutdown of the engine core and workers), SIGKILL if it hangs."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


# "(Worker pid=7) ERROR 11-30 12:07:47 [file.py:12] " in front of every line of a vLLM process.
_LOG_PREFIX = re.compile(
    r"^(?:\([\w-]+ pid=\d+\)\s*)?"
    r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:]+ \[[^\]]*\]\s*)?"
)
# Wrappers that only say "something above failed"; the cause is the line before them.
_GENERIC = (
    "Engine core initialization failed",
    "Worker failed with error",
    "WorkerProc initialization failed",
    "EngineDeadError",
)


def root_cause(log_text: str) -> str | None:
    """The root-cause line of a server failure (the first exception that is not a wrapper)."""
    found = []
    for raw in log_text.splitlines():
        line = _LOG_PREFIX.sub("", raw).strip()
        if re.match(r"^[\w.]*(Exception|Error)\b.*:", line) and "Traceback" not in line:
            found.append(line)
    for line in found:
        if not any(g in line for g in _GENERIC):
            return line
    return found[0] if found else None


@dataclass(frozen=True)
class PrefixCounters:
    """vLLM's prefix-cache counters: device (local) and connector (external), in tokens."""

    queries: float = 0.0
    hits: float = 0.0
    external_queries: float = 0.0
    external_hits: float = 0.0

    _NAMES = {
        "vllm:prefix_cache_queries": "queries",
        "vllm:prefix_cache_hits": "hits",
        "vllm:external_prefix_cache_queries": "external_queries",
        "vllm:external_prefix_cache_hits": "external_hits",
    }

    @classmethod
    def parse(cls, text: str) -> PrefixCounters:
        totals = dict.fromkeys(cls._NAMES.values(), 0.0)
        for line in text.splitlines():
            m = re.match(r"^(vllm:[a-z_]+?)(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
            if m and m.group(1) in cls._NAMES:
                totals[cls._NAMES[m.group(1)]] += float(m.group(2))
        return cls(**totals)

    def minus(self, other: PrefixCounters) -> PrefixCounters:
        return PrefixCounters(
            self.queries - other.queries,
            self.hits - other.hits,
            self.external_queries - other.external_queries,
            self.external_hits - other.external_hits,
        )

    def as_dict(self) -> dict[str, int]:
        return {
            "local_queries": int(self.queries),
            "local_hits": int(self.hits),
            "external_queries": int(self.external_queries),
            "external_hits": int(self.external_hits),
        }
