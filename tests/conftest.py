"""Shared pytest setup: CPU-engine environment defaults and the tiny hybrid model fixtures.

The environment is set at import time, before any test module imports vLLM: vLLM reads most
of these variables when ``vllm.envs`` is first imported, and subprocess engines inherit them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Values a test run needs on a small CPU box; anything the caller already set wins.
CPU_ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; keeps each engine's KV cache small
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # avoids core-reservation warnings on 2 cores
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: starts in seconds, not ~20 s
    "VLLM_CPU_CI_ENV": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",  # everything is built locally; never try the hub
    "TRANSFORMERS_OFFLINE": "1",
    # Every step plan the scheduler builds is checked: a host slot with two roles raises.
    "HIMAMBA_CHECK_PLANS": "1",
}
for _key, _value in CPU_ENGINE_ENV.items():
    os.environ.setdefault(_key, _value)

from tests.harness.tiny_models import (  # noqa: E402
    DEFAULT_CACHE_DIR,
    build_falcon_h1,
    build_granite_hybrid,
    build_granite_hybrid_wide_state,
    build_jamba,
    build_nemotron_h,
    build_qwen3_next,
)


@pytest.fixture(scope="session", autouse=True)
def cpu_engine_env() -> Iterator[dict[str, str]]:
    """Re-assert the CPU-engine defaults for the session (a test may have cleared one)."""
    for key, value in CPU_ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    yield {key: os.environ[key] for key in CPU_ENGINE_ENV}


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """Folder holding the built tiny models (``HIMAMBA_TEST_CACHE`` or ``<repo>/.cache/models``)."""
    return DEFAULT_CACHE_DIR


@pytest.fixture(scope="session")
def granite_model(model_cache_dir: Path) -> Path:
    """Tiny GraniteMoeHybrid (Mamba2 + attention, dense, fp32, random weights, tokenizer)."""
    return build_granite_hybrid(model_cache_dir)


@pytest.fixture(scope="session")
def granite_wide_state_model(model_cache_dir: Path) -> Path:
    """Tiny Granite whose Mamba state makes vLLM pick 256-token blocks (CPU default: 128)."""
    return build_granite_hybrid_wide_state(model_cache_dir)


@pytest.fixture(scope="session")
def qwen3next_model(model_cache_dir: Path) -> Path:
    """Tiny Qwen3-Next (GDN + attention, 4-expert MoE, bf16, random weights, tokenizer).

    bfloat16 because vLLM's CPU GDN kernel rejects anything else; a bf16 checkpoint lets
    ``dtype="auto"`` (the server default) work.
    """
    return build_qwen3_next(model_cache_dir, dtype="bfloat16")


@pytest.fixture(scope="session")
def falcon_h1_model(model_cache_dir: Path) -> Path:
    """Tiny Falcon-H1 (attention and Mamba2 in the same layers, fp32, random weights)."""
    return build_falcon_h1(model_cache_dir)


@pytest.fixture(scope="session")
def jamba_model(model_cache_dir: Path) -> Path:
    """Tiny Jamba (Mamba1 + attention, MoE, fp32): on vLLM's CPU build it runs through
    cpu_compat's Mamba1 scan and decode (``vllm_fixups.cpu_mamba1_scan``)."""
    return build_jamba(model_cache_dir)


@pytest.fixture(scope="session")
def nemotron_h_model(model_cache_dir: Path) -> Path:
    """Tiny Nemotron-H (Mamba2, MLP-only and attention layers; bf16 weights, so the engine can
    keep SSM states in float32 beside bf16 conv states, as Nemotron deployments do)."""
    return build_nemotron_h(model_cache_dir, dtype="bfloat16")
