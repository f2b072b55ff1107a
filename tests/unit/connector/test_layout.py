"""Which vLLM KV layouts the connector caches, and that it refuses the rest instead of guessing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from himamba.connector.layout import UnsupportedLayout, build_layout

VLLM_CONFIG = SimpleNamespace(
    cache_config=SimpleNamespace(hash_block_size=None),
    parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
)


def attention(**kw):
    return FullAttentionSpec(
        block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, **kw
    )


def mamba(mode="align"):
    return MambaSpec(
        block_size=128,
        shapes=((3, 544), (8, 64, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode=mode,
        page_size_padded=65536,
    )


def config(*specs):
    groups = [KVCacheGroupSpec([f"l{i}a", f"l{i}b"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def test_hybrid_layout_sizes_slots_from_real_page_bytes():
    layout = build_layout(VLLM_CONFIG, config(mamba(), attention()))
    assert layout.block_size == 128
    assert [g.group_id for g in layout.mamba] == [0]
    assert [g.group_id for g in layout.attention] == [1]
    # Mamba slots hold only the real state bytes (3*544*2 + 8*64*16*4), not the padded page.
    assert layout.mamba_slot_bytes == 2 * (3 * 544 * 2 + 8 * 64 * 16 * 4)
    assert layout.kv_slot_bytes == 2 * (128 * 2 * 64 * 2 * 2)
    kv, m = layout.slot_counts(1 << 30, 0.25)
    assert kv * layout.kv_slot_bytes <= (3 << 30) // 4
    assert m * layout.mamba_slot_bytes <= (1 << 30) // 4


def test_fingerprint_changes_when_the_state_dtype_changes():
    a = build_layout(VLLM_CONFIG, config(mamba(), attention()))
    other = MambaSpec(
        block_size=128,
        shapes=((3, 544), (8, 64, 16)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode="align",
        page_size_padded=65536,
    )
    b = build_layout(VLLM_CONFIG, config(other, attention()))
    assert a.fingerprint != b.fingerprint


@pytest.mark.parametrize(
    ("specs", "reason"),
    [
        ((attention(),), "not a hybrid"),
        ((mamba("none"), attention()), "align"),
        (
            (
                mamba(),
                SlidingWindowSpec(
                    block_size=128,
                    num_kv_heads=2,
                    head_size=64,
                    dtype=torch.bfloat16,
                    sliding_window=256,
                ),
            ),
            "SlidingWindowSpec",
        ),
    ],
)
def test_layouts_that_cannot_be_cached_exactly_are_refused_with_a_reason(specs, reason):
    with pytest.raises(UnsupportedLayout, match=reason):
        build_layout(VLLM_CONFIG, config(*specs))


@pytest.mark.parametrize(
    ("field", "reason"),
    [
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("decode_context_parallel_size", "DCP"),
        ("prefill_context_parallel_size", "PCP"),
    ],
)
def test_pipeline_and_context_parallel_layouts_are_refused_not_mis_sized(field, reason):
    # Each pipeline stage owns other layers (other slot sizes), and DCP/PCP shard attention
    # blocks by token: caching them with one slot layout would index past a stage's pool.
    par = SimpleNamespace(**{"tensor_parallel_size": 1, "pipeline_parallel_size": 1, field: 2})
    vllm_config = SimpleNamespace(cache_config=VLLM_CONFIG.cache_config, parallel_config=par)
    with pytest.raises(UnsupportedLayout, match=reason):
        build_layout(vllm_config, config(mamba(), attention()))
