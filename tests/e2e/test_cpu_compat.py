"""The CPU compatibility plugin (``himamba.connector.vllm_fixups.cpu_compat``) on a real vLLM CPU engine.

Each engine runs in its own subprocess (this file run as a script), so plugin state, vLLM's
``plugins_loaded`` flag and the engine's memory never leak into the pytest process. The child
prints one ``SPEC`` line once the engine is up and one ``RESULT`` line at the end, as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness.prefill_steps import record_prefill_chunks
from tests.harness.subprocess_run import child_env

PROMPT_LEN = 1000  # > one 128-token Mamba block, and not a multiple of it
ENGINE_TIMEOUT_S = 240
CRASH_TEXT = "out of bounds for dimension 0 with size 1"


def _prompt(n: int, seed: int = 7) -> list[int]:
    """Deterministic token ids that avoid the special ids 0-6 of the tiny vocabulary."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(7, 1024) for _ in range(n)]


def _run_engine(
    model: Path, *, plugins: bool, dtype: str = "float32", extra_env: dict[str, str] | None = None
) -> dict:
    """Run ``_child_main`` in a fresh interpreter; return its parsed output and exit code."""
    env = child_env()
    if plugins:
        env.pop("VLLM_PLUGINS", None)  # unset = load every general plugin
    else:
        env["VLLM_PLUGINS"] = ""  # allow-list with no names: no general plugin is loaded
    env.update(extra_env or {})
    args = json.dumps({"model": str(model), "dtype": dtype, "prompt_len": PROMPT_LEN})
    proc = subprocess.run(
        [sys.executable, "-m", "tests.e2e.test_cpu_compat", args],
        env=env,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    out = proc.stdout + proc.stderr
    parsed: dict[str, Any] = {"rc": proc.returncode, "output": out}
    for line in proc.stdout.splitlines():
        for tag in ("SPEC", "RESULT"):
            if line.startswith(tag + " "):
                parsed[tag.lower()] = json.loads(line[len(tag) + 1 :])
    return parsed


def _fail_text(res: dict) -> str:
    return f"rc={res['rc']}\n{res['output'][-6000:]}"


@pytest.mark.e2e
def test_granite_long_prompt_crashes_without_plugin(granite_model: Path) -> None:
    res = _run_engine(granite_model, plugins=False)
    assert res["rc"] != 0, _fail_text(res)
    assert "IndexError" in res["output"] and CRASH_TEXT in res["output"], _fail_text(res)
    spec = res["spec"]
    assert not spec["patched"]
    assert spec["mamba"]["num_prefill_checkpoint_blocks"] == 1


@pytest.mark.e2e
@pytest.mark.parametrize("export", [True, False], ids=["checkpoints-exported", "spec-fallback"])
def test_granite_prefix_cache_hit_is_exact_with_plugin(granite_model: Path, export: bool) -> None:
    """With the plugin the prompt is computed in one step as on a GPU (its state at the last
    block boundary saved from inside the chunk), and the hit on that state is exact; with
    the checkpoint export switched off the spec promises no checkpoints and the prompt takes
    a second step to the boundary, still exact."""
    env = {} if export else {"HIMAMBA_CPU_MAMBA2_CHECKPOINTS": "0"}
    res = _run_engine(granite_model, plugins=True, extra_env=env)
    assert res["rc"] == 0, _fail_text(res)
    spec, out = res["spec"], res["result"]
    assert spec["patched"]
    assert spec["mamba"]["layer_types"] == ["MambaMixer2"]
    assert spec["mamba"]["num_prefill_checkpoint_blocks"] == (1 if export else 0)
    block = spec["mamba"]["block_size"]
    boundary = (PROMPT_LEN - 1) // block * block
    assert out["first"]["num_cached_tokens"] == 0
    want_chunks = [PROMPT_LEN] if export else [boundary, PROMPT_LEN - boundary]
    assert out["first"]["prefill_chunks"] == want_chunks
    assert out["second"]["num_cached_tokens"] == boundary
    assert out["second"]["prefill_chunks"] == [PROMPT_LEN - boundary]
    assert out["second"]["tokens"] == out["first"]["tokens"]
    assert len(set(out["first"]["tokens"])) > 4, "greedy output degenerated into a loop"


@pytest.mark.e2e
def test_qwen3_next_runs_and_is_left_untouched_by_plugin(qwen3next_model: Path) -> None:
    # vLLM's CPU GDN kernel asserts bfloat16 ("CPU GDN attention requires BF16.").
    res = _run_engine(qwen3next_model, plugins=True, dtype="bfloat16")
    assert res["rc"] == 0, _fail_text(res)
    spec, out = res["spec"], res["result"]
    # GDN layers do not go through MambaMixer2.get_kv_cache_spec, so nothing was rewritten.
    assert "MambaMixer2" not in spec["mamba"]["layer_types"]
    assert not spec["mamba"]["wrapped_spec_methods"]
    assert spec["mamba"]["num_prefill_checkpoint_blocks"] == 0
    assert out["second"]["num_cached_tokens"] > 0
    assert out["second"]["tokens"] == out["first"]["tokens"]


def test_register_is_noop_off_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    from himamba.connector.vllm_fixups import cpu_compat

    monkeypatch.delenv(cpu_compat.ENV_DISABLE, raising=False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    mixer2 = sys.modules.get(cpu_compat.MIXER2_MODULE)
    before = mixer2.MambaMixer2.__dict__["get_kv_cache_spec"] if mixer2 else None

    cpu_compat.register()

    assert not any(isinstance(f, cpu_compat._PatchOnImport) for f in sys.meta_path)
    if mixer2 is not None:
        assert mixer2.MambaMixer2.__dict__["get_kv_cache_spec"] is before


def test_register_is_idempotent_and_env_switch_disables_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.model_executor.layers.mamba.ops import ssd_checkpoint, ssd_combined
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.platforms import current_platform

    from himamba.connector.vllm_fixups import cpu_compat

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: True)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    scan = ssd_combined._mamba_chunk_scan_combined_fwd
    # (owner, name, vLLM's own object); each restored on teardown
    targets = [
        (RotaryEmbedding, "forward_cpu", _unpatched(RotaryEmbedding.__dict__["forward_cpu"])),
        (ssd_combined, "_mamba_chunk_scan_combined_fwd", _unwrapped_scan(scan)),
        (mamba_mixer2, "store_prefill_checkpoint", ssd_checkpoint.store_prefill_checkpoint),
    ]
    spec_method = _unpatched(mamba_mixer2.MambaMixer2.__dict__["get_kv_cache_spec"])
    monkeypatch.setattr(mamba_mixer2.MambaMixer2, "get_kv_cache_spec", spec_method)
    for owner, name, original in targets:
        monkeypatch.setattr(owner, name, original)

    def current() -> list[Any]:
        return [vars(owner)[name] for owner, name, _ in targets]

    originals = [original for _, _, original in targets]
    monkeypatch.setenv(cpu_compat.ENV_DISABLE, "0")
    cpu_compat.register()
    assert current() == originals and not cpu_compat.is_patched()

    monkeypatch.delenv(cpu_compat.ENV_DISABLE)
    cpu_compat.register()
    patched = current()
    assert all(p is not o for p, o in zip(patched, originals, strict=True))
    assert cpu_compat.is_patched() and cpu_compat.is_rope_patched()
    assert cpu_compat.is_exporting_checkpoints()
    # Exported checkpoints keep vLLM's promise: the spec method is vLLM's own.
    assert mamba_mixer2.MambaMixer2.__dict__["get_kv_cache_spec"] is spec_method
    cpu_compat.register()
    assert current() == patched


def test_checkpoint_export_switched_off_drops_checkpoint_blocks_instead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.model_executor.layers.mamba.ops import ssd_checkpoint, ssd_combined

    from himamba.connector.vllm_fixups import cpu_compat

    scan = ssd_combined._mamba_chunk_scan_combined_fwd
    monkeypatch.setattr(ssd_combined, "_mamba_chunk_scan_combined_fwd", _unwrapped_scan(scan))
    monkeypatch.setattr(
        mamba_mixer2, "store_prefill_checkpoint", ssd_checkpoint.store_prefill_checkpoint
    )
    spec_method = _unpatched(mamba_mixer2.MambaMixer2.__dict__["get_kv_cache_spec"])
    monkeypatch.setattr(mamba_mixer2.MambaMixer2, "get_kv_cache_spec", spec_method)
    monkeypatch.setenv(cpu_compat.ENV_NO_CHECKPOINTS, "0")

    assert cpu_compat.patch_mamba_mixer2()
    assert mamba_mixer2.store_prefill_checkpoint is ssd_checkpoint.store_prefill_checkpoint
    assert mamba_mixer2.MambaMixer2.__dict__["get_kv_cache_spec"] is not spec_method
    assert cpu_compat.is_patched() and not cpu_compat.is_exporting_checkpoints()


def _unwrapped_scan(fn: Any) -> Any:
    return getattr(fn, "__wrapped__", fn)


def _unpatched(fn: Any) -> Any:
    """The vLLM function under this plugin's wrapper (``fn`` itself when not wrapped)."""
    from himamba.connector.vllm_fixups import cpu_compat

    while getattr(fn, cpu_compat._PATCH_FLAG, False):
        fn = fn.__wrapped__
    return fn


def _rope(head_size: int = 64) -> Any:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(
            head_size,
            max_position=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            is_neox_style=True,
        )


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_cpu_rope_patch_rotates_3d_query_key_like_the_native_rope(
    monkeypatch: pytest.MonkeyPatch, num_tokens: int
) -> None:
    """LFM2 hands ``[tokens, heads, head_size]`` q/k to the rope; on CPU the wrapped op must
    rotate every head of every token like ``forward_native`` (in place, same tensors back)."""
    import torch
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from himamba.connector.vllm_fixups import cpu_compat

    monkeypatch.setattr(
        RotaryEmbedding, "forward_cpu", _unpatched(RotaryEmbedding.__dict__["forward_cpu"])
    )
    assert cpu_compat.patch_cpu_rope() and cpu_compat.is_rope_patched()
    rope = _rope()
    gen = torch.Generator().manual_seed(num_tokens)
    q = torch.randn(num_tokens, 4, 64, generator=gen)
    k = torch.randn(num_tokens, 2, 64, generator=gen)
    positions = torch.arange(num_tokens) * 7 + 3
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())

    layouts = {
        "3-D": (q.clone(), k.clone()),
        "2-D": (q.clone().view(num_tokens, -1), k.clone().view(num_tokens, -1)),
        # heads-major storage: not viewable as [tokens, heads * head_size]
        "strided 3-D": (
            q.clone().transpose(0, 1).contiguous().transpose(0, 1),
            k.clone().transpose(0, 1).contiguous().transpose(0, 1),
        ),
    }
    for name, (q_in, k_in) in layouts.items():
        q_out, k_out = rope.forward_cpu(positions, q_in, k_in)
        assert q_out is q_in and k_out is k_in, name
        torch.testing.assert_close(q_in.reshape(want_q.shape), want_q, msg=name)
        torch.testing.assert_close(k_in.reshape(want_k.shape), want_k, msg=name)
    q_only, none = rope.forward_cpu(positions, q.clone(), None)
    assert none is None
    torch.testing.assert_close(q_only, want_q)


def test_stock_cpu_rope_mangles_3d_query_key() -> None:
    """The upstream behaviour the rope patch corrects: vLLM's CPU kernel reads only 2-D q/k.

    If this starts failing, vLLM fixed its kernel and the patch can go.
    """
    import torch
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    stock = _unpatched(RotaryEmbedding.__dict__["forward_cpu"])
    rope = _rope()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(8, 4, 64, generator=gen)
    k = torch.randn(8, 2, 64, generator=gen)
    positions = torch.arange(8)
    want_q, _ = rope.forward_native(positions, q.clone(), k.clone())
    got_q, _ = stock(rope, positions, q.clone(), k.clone())
    assert not torch.allclose(got_q, want_q, atol=1e-3)
    got_2d, _ = stock(rope, positions, q.clone().view(8, -1), k.clone().view(8, -1))
    torch.testing.assert_close(got_2d.view(8, 4, 64), want_q)


def test_import_hook_patches_each_module_once_and_then_leaves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from himamba.connector.vllm_fixups import cpu_compat

    for name in ("himamba_fake_a", "himamba_fake_b"):
        (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    calls: list[str] = []

    def patch_a() -> None:
        calls.append("a")

    def patch_b() -> None:
        calls.append("b")

    hook = cpu_compat._PatchOnImport({"himamba_fake_a": patch_a, "himamba_fake_b": patch_b})
    sys.meta_path.insert(0, hook)
    import himamba_fake_a  # noqa: F401

    assert calls == ["a"] and hook in sys.meta_path
    import himamba_fake_b  # noqa: F401

    assert calls == ["a", "b"] and hook not in sys.meta_path
    assert sys.modules["himamba_fake_b"].VALUE == 1


def test_spec_rewrite_only_drops_checkpoint_blocks() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from himamba.connector.vllm_fixups.cpu_compat import without_prefill_checkpoints

    spec = MambaSpec(
        block_size=128,
        shapes=((3, 544), (8, 64, 16)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=1,
    )
    fixed = without_prefill_checkpoints(spec, MambaSpec)
    assert fixed.num_prefill_checkpoint_blocks == 0
    assert fixed.prefill_checkpoint_alignment is None
    assert (fixed.shapes, fixed.block_size, fixed.page_size_bytes) == (
        spec.shapes,
        spec.block_size,
        spec.page_size_bytes,
    )
    plain = MambaSpec(block_size=128, shapes=spec.shapes, dtypes=spec.dtypes)
    assert without_prefill_checkpoints(plain, MambaSpec) is plain
    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    assert without_prefill_checkpoints(attn, MambaSpec) is attn


def test_missing_vllm_method_logs_and_skips(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    from himamba.connector.vllm_fixups import cpu_compat

    monkeypatch.delattr(MambaMixer2, "get_kv_cache_spec")
    cpu_compat._log_once.cache_clear()
    logger = cpu_compat.logger
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level("WARNING", logger=logger.name):
        assert cpu_compat.patch_mamba_mixer2() is False
        assert cpu_compat.patch_mamba_mixer2() is False
    assert "get_kv_cache_spec" not in MambaMixer2.__dict__
    assert len([r for r in caplog.records if "not applied" in r.getMessage()]) == 1
    cpu_compat._log_once.cache_clear()


# ---------------------------------------------------------------------------------------------
# Child process: one engine, one prompt run twice.


def _spec_summary(llm: Any) -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import MambaSpec

    from himamba.connector.vllm_fixups.cpu_compat import _PATCH_FLAG, is_patched

    core = llm.llm_engine.engine_core.engine_core
    kv_cfg = core.scheduler.kv_cache_config
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    groups, mamba = [], {}
    for group in kv_cfg.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append(
            {
                "type": type(spec).__name__,
                "layers": list(group.layer_names),
                "block_size": spec.block_size,
                "page_size_bytes": spec.page_size_bytes,
            }
        )
        if isinstance(spec, MambaSpec):
            mods = [layers[name] for name in group.layer_names]
            mamba = {
                "layer_types": sorted({type(m).__name__ for m in mods}),
                "wrapped_spec_methods": sorted(
                    {
                        type(m).__name__
                        for m in mods
                        if getattr(type(m).get_kv_cache_spec, _PATCH_FLAG, False)
                    }
                ),
                "num_prefill_checkpoint_blocks": spec.num_prefill_checkpoint_blocks,
                "block_size": spec.block_size,
                "page_size_bytes": spec.page_size_bytes,
                "real_page_size_bytes": spec.real_page_size_bytes,
                "shapes": [list(s) for s in spec.shapes],
                "dtypes": [str(d) for d in spec.dtypes],
            }
    return {
        "patched": is_patched(),
        "num_blocks": kv_cfg.num_blocks,
        "groups": groups,
        "mamba": mamba,
    }


def _child_main(args: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args["model"],
        load_format="auto",
        dtype=args["dtype"],
        enforce_eager=True,
        enable_prefix_caching=True,
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=4,
        seed=0,
    )
    spec = _spec_summary(llm)
    spec["engine_start_s"] = round(time.perf_counter() - t0, 2)
    print("SPEC " + json.dumps(spec), flush=True)

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    prompt = {"prompt_token_ids": _prompt(args["prompt_len"])}
    chunks = record_prefill_chunks(llm)  # tokens per step while a prompt is computed
    result = {}
    for name in ("first", "second"):
        t = time.perf_counter()
        chunks.clear()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        result[name] = {
            "tokens": list(out.outputs[0].token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "prefill_chunks": list(chunks),
            "seconds": round(time.perf_counter() - t, 3),
        }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
