"""A tiny LFM2 (``Lfm2ForCausalLM``: ShortConv + attention) checkpoint, built offline for tests.

Layers alternate ``conv`` / ``full_attention`` (4 by default), float32, hidden 256, vocabulary
1024, ``conv_L_cache`` 3. Weights are drawn with std 0.1 (norms keep their init): vLLM's
``load_format="dummy"`` weights (uniform +-1e-3) make greedy decoding collapse into a loop,
which would hide a wrong conv state. No tokenizer is written; engines run with
``skip_tokenizer_init=True`` and token-id prompts.

A build lands in ``<root>/<name>`` through a temporary folder and an atomic rename, with a
``.complete`` marker holding a fingerprint of the recipe; a folder whose marker matches is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE_DIR = Path(os.environ.get("HIMAMBA_TEST_CACHE") or REPO_ROOT / ".cache" / "models")

VOCAB_SIZE = 1024
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
WEIGHT_STD = 0.1
SEED = 1234
_MARKER = ".complete"
_RECIPE_VERSION = 1


def lfm2_config(dtype: str = "float32", n_layers: int = 4) -> dict[str, Any]:
    """Config of the tiny LFM2: ``conv, full_attention, conv, full_attention, ...``."""
    layer_types = ["conv" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    hidden = 256
    return {
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": 512,
        "num_hidden_layers": n_layers,
        "layer_types": layer_types,
        "full_attn_idxs": [i for i, t in enumerate(layer_types) if t == "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True,
        # vLLM's Lfm2 reads these names (real LFM2 checkpoints carry them too).
        "conv_dim": hidden,
        "conv_dim_out": hidden,
        "block_dim": hidden,
        "conv_L_cache": 3,
        "conv_bias": False,
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": dtype,
    }


def build_lfm2(root: Path = DEFAULT_CACHE_DIR, dtype: str = "float32") -> Path:
    """Build (or reuse) the tiny LFM2 checkpoint; return its folder."""
    config = lfm2_config(dtype)
    root = Path(root)
    target = root / f"lfm2-{dtype}"
    fingerprint = _fingerprint(config)
    if _is_complete(target, fingerprint):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared between users.
    try:
        _write_weights(tmp, config)
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

    cfg = dict(config)
    model_type = cfg.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            param.copy_(torch.randn(param.shape, generator=gen) * WEIGHT_STD)
    model = model.to(getattr(torch, config["dtype"]))
    model.config.architectures = config["architectures"]
    model.save_pretrained(str(out), safe_serialization=True)


if __name__ == "__main__":
    import sys

    print(build_lfm2(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_CACHE_DIR))
