"""Mamba1 hybrids (Jamba) on vLLM's CPU build, through cpu_compat's Mamba1 ops.

vLLM's CPU build has no Mamba1 prefill scan and a decode op that only reads Mamba2's layout
(``vllm_fixups.cpu_mamba1_scan``). With the plugin, a tiny Jamba's greedy tokens must equal
transformers' own Jamba (its PyTorch reference scan), computed in one prefill step and in
several chunks; the connector's hits on it are in ``test_cpu_tier.py``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from tests.harness.offline_engine import prompt
from tests.harness.subprocess_run import run_scenario

pytestmark = pytest.mark.e2e

NEW_TOKENS = 16
# Two greedy choices closer than this in transformers' own logits are a tie that float
# rounding may break either way; any other difference is a wrong token.
TIE_GAP = 1e-3


@functools.cache
def _transformers_model(model: Path) -> Any:
    """transformers' own Jamba for the checkpoint (its PyTorch reference scan), loaded once."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)


def _reference(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    import torch

    hf = _transformers_model(model)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(gen[0, len(p) :].tolist())
    return out


def _first_gap(model: Path, context: list[int], a: int, b: int) -> float:
    """transformers' logit gap between tokens ``a`` and ``b`` after ``context``."""
    import torch

    with torch.no_grad():
        logits = _transformers_model(model)(torch.tensor([context])).logits[0, -1]
    return abs(float(logits[a] - logits[b]))


def test_jamba_prefill_fails_on_stock_vllm_cpu(jamba_model: Path) -> None:
    """What the fix is for (if vLLM's CPU build gains the op, this fails and the fix can go)."""
    with pytest.raises(AssertionError, match="selective_scan_fwd"):
        run_scenario(
            "baseline",
            {"model": str(jamba_model), "prompts": [prompt(1, 200)]},
            env={"VLLM_PLUGINS": ""},  # no general plugin: stock vLLM
        )


@pytest.mark.parametrize("chunk", [None, 128], ids=["one-step", "chunked-128"])
def test_jamba_tokens_equal_transformers_reference(jamba_model: Path, chunk: int | None) -> None:
    prompts = [prompt(1, 200), prompt(2, 333)]
    args = {"model": str(jamba_model), "prompts": prompts}
    if chunk is not None:
        args["max_num_batched_tokens"] = chunk
    got = [r["tokens"] for r in run_scenario("baseline", args)["single"]]
    want = _reference(jamba_model, prompts)
    for p, g, w in zip(prompts, got, want, strict=True):
        assert len(set(w)) > 4, "the reference degenerated into a loop: weights too small"
        if g == w:
            continue
        k = next(i for i, (x, y) in enumerate(zip(g, w, strict=True)) if x != y)
        gap = _first_gap(jamba_model, p + w[:k], g[k], w[k])
        assert gap < TIE_GAP, f"token {k}: vLLM {g[k]}, transformers {w[k]} (gap {gap:.2e})"
