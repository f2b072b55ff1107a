"""Builds vLLM's real scheduler-side objects for a tiny hybrid model, the way EngineCore does.

Why not a hand-written ``KVCacheConfig``: the grouping, the Mamba page padding and the
aliasing of groups onto one backing buffer are decisions vLLM makes in
``get_kv_cache_configs``; a connector that only works on a hand-drawn layout proves little.
So the specs are small (16-token blocks, 1 KiB attention pages, 224-byte Mamba states) but
everything after them is vLLM's own code path: grouping, ``generate_scheduler_kv_cache_config``,
``resolve_kv_cache_block_sizes``, the scheduler class chosen by ``get_scheduler_cls`` and the
per-layer views of ``allocate_kv_cache``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.interface import SchedulerInterface
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

try:  # vLLM 0.33 moved planning out of kv_cache_utils and groups in a separate pass.
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    get_global_kv_cache_groups = None

CONNECTOR_MODULE = "himamba.connector.vllm_connector"
CONNECTOR_CLASS = "HiMambaConnector"
# vLLM's CPU attention backend supports exactly this layout; EngineCore would resolve it.
CPU_KV_LAYOUT = "LBHNC"
# Layer names as the tiny GraniteMoeHybrid has them: Mamba2, attention, Mamba2, attention.
MAMBA_LAYERS = ("model.layers.0.mixer", "model.layers.2.mixer")
ATTENTION_LAYERS = ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")
VOCAB_SIZE = 1024


@dataclass(frozen=True)
class EngineSpec:
    """Everything that shapes one simulated engine; tests vary one field at a time."""

    block_size: int = 16
    num_gpu_blocks: int = 256
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    async_scheduling: bool = False
    # vLLM's Model Runner V2 (a GPU engine's default where Triton is present; the CPU build
    # cannot run it): it zeroes a step's new blocks, applies block copies and moves Mamba
    # states before the connector's first worker hook, where V1 calls that hook first.
    model_runner_v2: bool = False
    # With V2: himamba's step-start hook (connector.vllm_fixups.runner_v2_hook), which the
    # stand-in runner calls where the wrapped ``execute_model`` would; False: the fallback.
    v2_step_hook: bool = True
    tensor_parallel_size: int = 1
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    # Passed verbatim as kv_connector_extra_config (cpu_cache_gb, storage, ...).
    connector_config: dict[str, Any] = field(default_factory=dict)
    # False: no KV connector at all (the baseline of benchmarks).
    with_connector: bool = True
    # Attention: 1 KV head of 8 fp32 values -> 16 tokens x 64 B = 1 KiB pages.
    num_kv_heads: int = 1
    head_size: int = 8
    # Mamba2-like conv + ssm state: 96 + 128 = 224 bytes, padded by vLLM to the attention page.
    mamba_shapes: tuple[tuple[int, ...], ...] = ((3, 8), (2, 4, 4))


def write_model_dir(root: Path) -> Path:
    """A tiny GraniteMoeHybrid folder: ModelConfig needs a real HF config to derive what vLLM
    derives for a hybrid (align mode, chunked prefill). Nothing loads weights here, but the
    storage namespace is keyed by the weights' identity, so one small tensor file stands in."""
    import numpy as np
    from safetensors.numpy import save_file

    from tests.harness.tiny_models import granite_hybrid_config

    root.mkdir(parents=True, exist_ok=True)
    config = granite_hybrid_config("float32")
    config["max_position_embeddings"] = 32768  # room for the benchmark's 4k prompts + decode
    (root / "config.json").write_text(json.dumps(config))
    save_file(
        {"lifecycle.stand_in": np.arange(64, dtype=np.float32)}, str(root / "model.safetensors")
    )
    return root


def make_model_config(model_dir: Path, max_model_len: int) -> ModelConfig:
    """Slow the first time on a machine (vLLM inspects the architecture in a subprocess and
    caches it); callers share one and deep-copy it per engine."""
    return ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=max_model_len,
        seed=0,
    )


def make_vllm_config(spec: EngineSpec, model_config: ModelConfig) -> VllmConfig:
    scheduler_config = SchedulerConfig(
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=spec.async_scheduling,
    )
    cache_config = CacheConfig(block_size=spec.block_size, enable_prefix_caching=True)
    kv_transfer = None
    if spec.with_connector:
        kv_transfer = KVTransferConfig(
            kv_connector=CONNECTOR_CLASS,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_connector_extra_config=copy.deepcopy(spec.connector_config),
            kv_load_failure_policy=spec.kv_load_failure_policy,
        )
    parallel = ParallelConfig(tensor_parallel_size=spec.tensor_parallel_size)
    model_config = copy.deepcopy(model_config)
    model_config.max_model_len = spec.max_model_len
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer,
        parallel_config=parallel,
        device_config=DeviceConfig("cpu"),
    )
    # EngineCore resolves the layout from the workers' attention backends before sizing.
    config.cache_config.kv_cache_layout = CPU_KV_LAYOUT
    # vLLM's CPU platform turns async scheduling off; a GPU engine runs it by default, with
    # vLLM's AsyncScheduler (output placeholders, a step scheduled before the previous one's
    # output is known). The async engines here run that scheduler, as a GPU engine does.
    config.scheduler_config.async_scheduling = spec.async_scheduling
    return config


def layer_specs(spec: EngineSpec) -> dict[str, Any]:
    attention = FullAttentionSpec(
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=torch.float32,
    )
    mamba = MambaSpec(
        block_size=spec.block_size,
        shapes=spec.mamba_shapes,
        dtypes=tuple(torch.float32 for _ in spec.mamba_shapes),
        mamba_cache_mode="align",
    )
    layers: dict[str, Any] = {}
    for m, a in zip(MAMBA_LAYERS, ATTENTION_LAYERS, strict=True):
        layers[m] = mamba
        layers[a] = attention
    return layers


@dataclass
class KVSetup:
    """The per-worker configs and the scheduler's, resolved as EngineCore resolves them."""

    worker_configs: list[KVCacheConfig]
    scheduler_config: KVCacheConfig
    block_size: int
    hash_block_size: int


def resolve_kv_cache(spec: EngineSpec, vllm_config: VllmConfig) -> KVSetup:
    world = spec.tensor_parallel_size
    specs = layer_specs(spec)
    page = max(s.page_size_bytes for s in specs.values())
    memory = spec.num_gpu_blocks * page * len(MAMBA_LAYERS)
    if get_global_kv_cache_groups is None:
        configs = get_kv_cache_configs(vllm_config, [specs] * world, [memory] * world)
    else:
        groups = get_global_kv_cache_groups(vllm_config, [specs] * world)
        configs = get_kv_cache_configs(vllm_config, [specs] * world, [memory] * world, groups)
    for cfg in configs:
        cfg.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    sched_cfg = generate_scheduler_kv_cache_config(configs)
    vllm_config.cache_config.num_gpu_blocks = sched_cfg.num_blocks
    vllm_config.cache_config.block_size = min(
        g.kv_cache_spec.block_size for g in sched_cfg.kv_cache_groups
    )
    block_size, hash_block_size = resolve_kv_cache_block_sizes(sched_cfg, vllm_config)
    for cfg in (*configs, sched_cfg):
        cfg.hash_block_size = hash_block_size
    return KVSetup(configs, sched_cfg, block_size, hash_block_size)


def make_scheduler(vllm_config: VllmConfig, kv: KVSetup) -> SchedulerInterface:
    """The scheduler class vLLM picks for this config (Scheduler or AsyncScheduler); its
    constructor builds the scheduler-role connector through vLLM's connector factory."""
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv.scheduler_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=kv.block_size,
        hash_block_size=kv.hash_block_size,
        log_stats=True,
    )


def allocate_worker_caches(kv_cache_config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """vLLM's own allocation: one zeroed int8 buffer, groups aliased from byte 0, typed
    ``[B, H, N, C]`` views for attention and raw int8 ``[B, 1, 1, C]`` views for Mamba."""
    layout = KVCacheLayout[CPU_KV_LAYOUT]
    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)


_hasher_ready = False


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    hash_block_size: int,
    cache_salt: str | None = None,
) -> Request:
    """A request as the engine frontend hands it over: sha256 block hashes, no EOS stop."""
    global _hasher_ready
    if not _hasher_ready:
        init_none_hash(sha256)
        _hasher_ready = True
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(hash_block_size, sha256),
    )
