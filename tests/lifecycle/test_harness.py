"""The harness is built the way vLLM builds an engine for a hybrid model with prefix caching;
if vLLM's defaults move, these fail before any lifecycle test gives a misleading pass."""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import MambaSpec

from .conftest import connector_config


def test_engine_config_is_vllms_hybrid_prefix_caching_setup(make_engine):
    engine = make_engine(connector_config=connector_config())
    cache = engine.vllm_config.cache_config
    assert cache.enable_prefix_caching
    assert cache.mamba_cache_mode == "align"
    # vLLM's default is 0 (prompt ends and junctions only); himamba's keep_decode_states sets it
    # to the block size so states inside generated output reach the connector.
    assert cache.prefix_cache_retention_interval == 16
    assert engine.kv.scheduler_config.prefix_cache_retention_interval == 16
    assert engine.vllm_config.scheduler_config.enable_chunked_prefill
    assert engine.scheduler.need_mamba_block_aligned_split
    groups = engine.kv.scheduler_config.kv_cache_groups
    kinds = sorted(type(g.kv_cache_spec).__name__ for g in groups)
    assert kinds == ["FullAttentionSpec", "MambaSpec"]
    assert engine.kv.block_size == engine.kv.hash_block_size == 16


def test_worker_tensors_are_laid_out_as_vllm_allocates_them(make_engine):
    engine = make_engine(connector_config=connector_config())
    runner = engine.runners[0]
    caches = runner.kv_caches
    num_blocks = engine.kv.worker_configs[0].num_blocks
    for group in engine.kv.worker_configs[0].kv_cache_groups:
        for name in group.layer_names:
            t = caches[name]
            assert t.shape[0] == num_blocks  # block axis 0
            if isinstance(group.kv_cache_spec, MambaSpec):
                assert t.dtype == torch.int8 and t.shape[1:3] == (1, 1)
                assert t.shape[3] == group.kv_cache_spec.real_page_size_bytes
    # Groups alias one backing buffer from byte 0, as vLLM's allocator does.
    assert len({t.untyped_storage().data_ptr() for t in caches.values()}) == 1
    assert engine.runners[0].connector is not engine.connector
