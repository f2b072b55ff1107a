"""Tiny hybrid (attention + Mamba-type state) checkpoints, built offline for tests.

vLLM needs a real checkpoint folder (config, safetensors, optional tokenizer), and the Hugging
Face hub is unreachable here, so the models are built from a config with transformers' random
init and written with ``save_pretrained``. vLLM's own ``load_format="dummy"`` weights are too
small (uniform +-1e-3): greedy decoding falls into a two-token loop, which would hide state
corruption. Weights drawn with std ~0.1 keep greedy outputs diverse, so a wrong Mamba state
shows up as different tokens.

A build lands in ``<root>/<name>`` through a temporary folder and an atomic rename, with a
``.complete`` marker holding a fingerprint of the recipe. A folder whose marker matches is reused
(within a test run and across runs); anything else is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE_DIR = Path(os.environ.get("HIMAMBA_TEST_CACHE") or REPO_ROOT / ".cache" / "models")

VOCAB_SIZE = 1024
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
WEIGHT_STD = 0.1
SEED = 1234
_MARKER = ".complete"
# Bump when a builder changes in a way the config fingerprint does not capture.
_RECIPE_VERSION = 1

# Parameters that keep transformers' init: norms (ones, or zeros for Qwen3-Next's 1+w norms)
# and the SSM/GDN dynamics (A_log, dt_bias, D), which random values would make unstable.
_KEEP_INIT_SUFFIXES = ("norm.weight", "A_log", "dt_bias", ".D")

_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} {{ message['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
)


def _tiny(architecture: str, model_type: str, dtype: str, **fields: Any) -> dict[str, Any]:
    """The fields every tiny model shares (vocabulary, widths, special ids), plus its own."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": dtype,
        **fields,
    }


def _alternating(n_layers: int) -> list[str]:
    return ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]


def granite_hybrid_config(dtype: str = "float32") -> dict[str, Any]:
    """GraniteMoeHybrid, dense (``num_local_experts=0``): Mamba2, attention, Mamba2, attention."""
    return _tiny(
        "GraniteMoeHybridForCausalLM",
        "granitemoehybrid",
        dtype,
        shared_intermediate_size=512,
        num_local_experts=0,
        num_experts_per_tok=0,
        num_hidden_layers=4,
        layer_types=_alternating(4),
        hidden_act="silu",
        position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        embedding_multiplier=1.0,
        logits_scaling=1.0,
        residual_multiplier=1.0,
        attention_multiplier=0.125,
        mamba_n_heads=8,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_head=64,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
    )


def qwen3_next_config(dtype: str = "float32") -> dict[str, Any]:
    """Qwen3-Next: GDN (gated delta net), attention, GDN, attention; a 4-expert MoE in every layer.

    vLLM's Qwen3-Next needs at least one sparse MoE layer, so ``decoder_sparse_step=1``.
    """
    return _tiny(
        "Qwen3NextForCausalLM",
        "qwen3_next",
        dtype,
        num_hidden_layers=4,
        layer_types=_alternating(4),
        head_dim=64,
        hidden_act="silu",
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        norm_topk_prob=True,
    )


def falcon_h1_config(dtype: str = "float32") -> dict[str, Any]:
    """Falcon-H1: attention and a Mamba2 mixer side by side in every layer (four layers)."""
    return _tiny(
        "FalconH1ForCausalLM",
        "falcon_h1",
        dtype,
        num_hidden_layers=4,
        head_dim=64,
        mamba_d_ssm=512,
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        tie_word_embeddings=True,
    )


def nemotron_h_config(dtype: str = "float32") -> dict[str, Any]:
    """Nemotron-H: Mamba2, MLP-only and attention layers in a pattern (six layers, two of each:
    the MLP layers hold no cache at all)."""
    return _tiny(
        "NemotronHForCausalLM",
        "nemotron_h",
        dtype,
        layers_block_type=["mamba", "mlp", "attention", "mamba", "mlp", "attention"],
        head_dim=64,
        ssm_state_size=16,
        mamba_num_heads=8,
        mamba_head_dim=64,
        n_groups=1,
        conv_kernel=4,
        expand=2,
        chunk_size=256,
        tie_word_embeddings=True,
    )


def jamba_config(dtype: str = "float32") -> dict[str, Any]:
    """Jamba: Mamba1 (per-channel SSM, not Mamba2's heads), attention, Mamba1, attention; a
    2-expert MoE in every other layer. Untied embeddings: vLLM's Jamba has its own LM head."""
    return _tiny(
        "JambaForCausalLM",
        "jamba",
        dtype,
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=16,
        tie_word_embeddings=False,
    )


def build_granite_hybrid(root: Path = DEFAULT_CACHE_DIR, dtype: str = "float32") -> Path:
    """Build (or reuse) the tiny GraniteMoeHybrid checkpoint with a tokenizer; return its folder."""
    return build_model(root, f"granite-hybrid-{dtype}", granite_hybrid_config(dtype))


def build_granite_hybrid_wide_state(root: Path = DEFAULT_CACHE_DIR) -> Path:
    """The tiny Granite with a 4x larger SSM state (d_state 64): vLLM then enlarges the block to
    256 tokens (an attention page must hold a Mamba state page), unlike the CPU default 128."""
    config = granite_hybrid_config("float32")
    config["mamba_d_state"] = 64
    return build_model(root, "granite-hybrid-wide-state-float32", config)


def build_qwen3_next(root: Path = DEFAULT_CACHE_DIR, dtype: str = "float32") -> Path:
    """Build (or reuse) the tiny Qwen3-Next checkpoint with a tokenizer; return its folder."""
    return build_model(root, f"qwen3-next-{dtype}", qwen3_next_config(dtype))


def build_falcon_h1(root: Path = DEFAULT_CACHE_DIR, dtype: str = "float32") -> Path:
    """Build (or reuse) the tiny Falcon-H1 checkpoint with a tokenizer; return its folder."""
    return build_model(root, f"falcon-h1-{dtype}", falcon_h1_config(dtype))


def build_nemotron_h(root: Path = DEFAULT_CACHE_DIR, dtype: str = "float32") -> Path:
    """Build (or reuse) the tiny Nemotron-H checkpoint with a tokenizer; return its folder."""
    return build_model(root, f"nemotron-h-{dtype}", nemotron_h_config(dtype))


def build_jamba(root: Path = DEFAULT_CACHE_DIR, dtype: str = "float32") -> Path:
    """Build (or reuse) the tiny Jamba checkpoint with a tokenizer; return its folder."""
    return build_model(root, f"jamba-{dtype}", jamba_config(dtype))


def build_tokenizer(model_dir: Path) -> None:
    """Write a 1024-word WordLevel tokenizer and a chat template into ``model_dir``.

    Words are ``<pad> <s> </s> <unk> system user assistant t7 ... t1023``, so ids match the
    model vocabulary and chat roles are real tokens. Text prompts are space-separated words.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = specials + ["system", "user", "assistant"]
    words += [f"t{i}" for i in range(len(words), VOCAB_SIZE)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # WordPiece joins tokens with spaces, which is what a word-level vocabulary needs.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=4096,
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(model_dir))


def build_model(root: Path, name: str, config: dict[str, Any]) -> Path:
    """Write (once, cached by a fingerprint of ``config``) a tiny random-weight checkpoint."""
    root = Path(root)
    target = root / name
    fingerprint = _fingerprint(config)
    if _is_complete(target, fingerprint):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared between users.
    try:
        _write_weights(tmp, config)
        build_tokenizer(tmp)
        (tmp / _MARKER).write_text(fingerprint)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same build first; use its copy if it is complete.
            if not _is_complete(target, fingerprint):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _fingerprint(config: dict[str, Any]) -> str:
    blob = json.dumps(
        {"config": config, "std": WEIGHT_STD, "seed": SEED, "recipe": _RECIPE_VERSION},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _is_complete(path: Path, fingerprint: str) -> bool:
    marker = path / _MARKER
    return marker.is_file() and marker.read_text().strip() == fingerprint


def _write_weights(out: Path, config: dict[str, Any]) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = dict(config)
    model_type = cfg_dict.pop("model_type")
    dtype = getattr(torch, cfg_dict["dtype"])
    hf_config = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    _randomize(model.named_parameters, torch)
    model = model.to(dtype)
    model.config.architectures = config["architectures"]
    model.save_pretrained(str(out), safe_serialization=True)


def _randomize(named_parameters: Callable[[], Any], torch: Any) -> None:
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in named_parameters():
            if name.endswith(_KEEP_INIT_SUFFIXES):
                continue
            param.copy_(torch.randn(param.shape, generator=gen) * WEIGHT_STD)


if __name__ == "__main__":
    import sys

    out_root = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_CACHE_DIR
    print(build_granite_hybrid(out_root))
    print(build_qwen3_next(out_root))
