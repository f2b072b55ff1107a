"""A tiny LFM2 (``Lfm2ForCausalLM``: ShortConv + attention) checkpoint, built offline for tests.

Layers alternate ``conv`` / ``full_attention`` (4 by default), float32, hidden 256, vocabulary
1024, ``conv_L_cache`` 3. Weights are drawn with std 0.1 (norms keep their init): vLLM's
``load_format="dummy"`` weights (uniform +-1e-3) make greedy decoding collapse into a loop,
which would hide a wrong conv state. Engines run with ``skip_tokenizer_init=True`` and token-id
prompts. Built and cached like the other tiny models (``tiny_models.build_model``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.harness.tiny_models import DEFAULT_CACHE_DIR, build_model

VOCAB_SIZE = 1024
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


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
    """The tiny LFM2 checkpoint (cached; same random-weight recipe as the other tiny models)."""
    return build_model(root, f"lfm2-{dtype}", lfm2_config(dtype))


if __name__ == "__main__":
    import sys

    print(build_lfm2(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_CACHE_DIR))
