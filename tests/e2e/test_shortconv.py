"""LFM2 (ShortConv + attention) on a real vLLM CPU engine: a prompt that extends a cached prefix
generates exactly the tokens of a cold run, from vLLM's device cache and from the CPU tier.

Prompts come from the engine's block size ``bs`` (n = PREFIX_BLOCKS): A has ``n*bs + 104``
tokens (its state at ``n*bs`` is a prefill-chunk end, so it is cached); B and C keep A's first
``n*bs + 4`` tokens and add a new tail that crosses the next block boundary. A hit on B computes
tokens ``n*bs..(n+1)*bs`` as one forward batch on top of the cached prefix, while the cold
reference (a fresh engine with prefix caching off) computes the whole prompt in one batch, so
any batching-dependent error shows up as different tokens. Without himamba's CPU compat plugin
it does (vLLM's CPU rotary kernel mangles LFM2's 3-D query/key; see ``cpu_compat``): with
``HIMAMBA_CPU_COMPAT=0`` the two exactness tests fail, and
``test_without_the_fix_a_prefix_hit_diverges`` pins that these prompts exercise the bug.

Each engine set runs in its own interpreter (this file as a script): vLLM keeps the worker-side
connector and the plugin patches process-global. The child prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness.subprocess_run import child_env

pytestmark = pytest.mark.e2e

CHILD_TIMEOUT_S = 300
MAX_TOKENS = 48
PREFIX_BLOCKS = 3
CPU_TIER_EXTRA = {"cpu_cache_gb": 0.05}


def _tokens(seed: int, n: int) -> list[int]:
    """Deterministic token ids that avoid the special ids 0-6 of the tiny vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(7, 1000) for _ in range(n)]


def make_prompts(block_size: int) -> dict[str, list[int]]:
    """A, and two prompts sharing A's first ``n*bs + 4`` tokens whose tails cross ``(n+1)*bs``."""
    a = _tokens(1, PREFIX_BLOCKS * block_size + 104)
    shared = a[: PREFIX_BLOCKS * block_size + 4]
    tail = (PREFIX_BLOCKS + 1) * block_size + 26 - len(shared)
    return {"a": a, "b": shared + _tokens(2, tail), "c": shared + _tokens(3, tail)}


def _run_child(mode: str, model: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``_child_main(mode)`` in a fresh interpreter; return its RESULT and output.

    One child at a time: an engine's OpenMP threads spin, so children side by side on a small
    box are slower than in turn.
    """
    full_env = child_env(env)
    full_env.pop("VLLM_PLUGINS", None)  # unset = every general plugin, himamba's included
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.e2e.test_shortconv",
            json.dumps({"mode": mode, "model": str(model)}),
        ],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    out = proc.stdout + proc.stderr
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT ") :]), "output": out}
    raise AssertionError(f"child {mode} failed (rc={proc.returncode}):\n{out[-6000:]}")


@pytest.fixture(scope="module")
def lfm2_model() -> Path:
    from tests.harness.lfm2 import build_lfm2

    return build_lfm2()


@pytest.fixture(scope="module")
def device_run(lfm2_model: Path) -> dict[str, Any]:
    return _run_child("device", lfm2_model)


def _assert_hit(run: dict[str, Any], name: str, block_size: int) -> None:
    assert run[name]["cached"] == PREFIX_BLOCKS * block_size, (name, run[name], block_size)


def test_device_prefix_hit_on_an_extended_prompt_matches_a_cold_engine(device_run):
    bs = device_run["block_size"]
    assert device_run["a"]["cached"] == 0
    _assert_hit(device_run, "b", bs)
    cold = device_run["cold"]
    assert cold["b"]["cached"] == 0 and cold["c"]["cached"] == 0
    assert device_run["b"]["tokens"] == cold["b"]["tokens"]
    assert len(set(cold["b"]["tokens"])) > 4, "greedy output degenerated into a loop"


def test_cpu_tier_hit_on_an_extended_prompt_matches_a_cold_engine(lfm2_model, device_run):
    run = _run_child("connector", lfm2_model)
    bs = run["block_size"]
    assert bs == device_run["block_size"], "both engines must see the same prompts"
    assert "connector inert" not in run["output"], run["output"][-4000:]
    assert run["a"]["cached"] == 0
    # reset_prefix_cache() emptied the device cache before C: its hit came from the CPU tier.
    _assert_hit(run, "c", bs)
    assert run["stats"].get("loads", 0) >= 1 and run["stats"].get("loads_failed", 0) == 0
    assert run["c"]["tokens"] == device_run["cold"]["c"]["tokens"]


def test_without_the_fix_a_prefix_hit_diverges(lfm2_model):
    run = _run_child("device_unfixed", lfm2_model, env={"HIMAMBA_CPU_COMPAT": "0"})
    assert not run["rope_patched"]
    _assert_hit(run, "b", run["block_size"])
    # The same engine after reset_prefix_cache(): B computed cold, batched differently.
    assert run["b_cold"]["cached"] == 0
    assert run["b"]["tokens"] != run["b_cold"]["tokens"], (
        "vLLM's CPU rotary kernel now handles 3-D query/key: the LFM2 fix in cpu_compat "
        "may no longer be needed"
    )


# ---------------------------------------------------------------------------------------------
# Child process.


def _engine(model: str, prefix_caching: bool, extra: dict[str, Any] | None = None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if extra is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HiMambaConnector",
            kv_connector_module_path="himamba.connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    return LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=prefix_caching,
        skip_tokenizer_init=True,
        max_model_len=4096,
        max_num_seqs=4,
        seed=0,
        **kw,
    )


def _close(llm: Any) -> None:
    import gc

    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the next engine or the exit follows
        pass
    del llm
    ensure_kv_transfer_shutdown()
    gc.collect()


def _generate(llm: Any, prompt: list[int]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}


def _rope_patched() -> bool:
    from himamba.connector.vllm_fixups.cpu_compat import is_rope_patched

    return is_rope_patched()


def _child_main(args: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    model, mode = args["model"], args["mode"]
    result: dict[str, Any] = {"mode": mode}
    if mode == "device":
        llm = _engine(model, prefix_caching=True)
        block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
        prompts = make_prompts(block_size)
        result["a"] = _generate(llm, prompts["a"])
        result["b"] = _generate(llm, prompts["b"])
        _close(llm)
        llm = _engine(model, prefix_caching=False)
        result["cold"] = {name: _generate(llm, prompts[name]) for name in ("b", "c")}
        _close(llm)
    elif mode == "device_unfixed":
        llm = _engine(model, prefix_caching=True)
        block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
        prompts = make_prompts(block_size)
        result["a"] = _generate(llm, prompts["a"])
        result["b"] = _generate(llm, prompts["b"])
        llm.reset_prefix_cache()
        result["b_cold"] = _generate(llm, prompts["b"])
        _close(llm)
    elif mode == "connector":
        llm = _engine(model, prefix_caching=True, extra=CPU_TIER_EXTRA)
        block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
        prompts = make_prompts(block_size)
        result["a"] = _generate(llm, prompts["a"])
        llm.reset_prefix_cache()
        result["c"] = _generate(llm, prompts["c"])
        core = llm.llm_engine.engine_core.engine_core
        result["stats"] = core.scheduler.connector.stats()
        _close(llm)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    result["block_size"] = block_size
    result["rope_patched"] = _rope_patched()
    result["s"] = round(time.perf_counter() - t0, 1)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    # The engine defaults of tests/conftest.py, for a child started outside pytest too.
    for key, value in {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_CI_ENV": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }.items():
        os.environ.setdefault(key, value)
    _child_main(json.loads(sys.argv[1]))
