"""Builds the storage tier for one connector role: config, namespace, LMCache store.

Both roles open the same backend: the scheduler only asks ``exists`` (to plan
prefetches), workers put and get bytes (they own the host pool). Namespaces
carry the TP rank, so each worker reads back only its own shard.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from himamba.connector.layout import HybridLayout
from himamba.tiers.config_fields import installed
from himamba.tiers.object_format import LayoutFingerprint, Namespace
from himamba.tiers.storage_config import StorageConfig

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, VllmConfig

    from himamba.tiers.byte_store import ByteStore

logger = logging.getLogger(__name__)


STORAGE_EXTRA = "pip install 'himamba[storage]'"


def storage_config(raw: dict[str, Any] | None) -> StorageConfig | None:
    if raw is None:
        return None
    try:
        cfg = StorageConfig.from_dict(raw)
    except ValueError as exc:
        # Already names the key as ``storage.<key>``; say whose config it is.
        raise ValueError(f"himamba: {exc}") from None
    require_storage_extra()
    return cfg


def require_storage_extra() -> None:
    """The storage tier runs on LMCache, an optional extra (it pulls ~40 packages a CPU-tier
    user does not need): fail at start-up, naming the extra, rather than deep in an adapter."""
    if not installed("lmcache"):
        raise ValueError(
            "himamba: kv_connector_extra_config.storage is set but LMCache is not installed; "
            f"the storage tier is an extra: {STORAGE_EXTRA}"
        )


def storage_namespace(
    vllm_config: VllmConfig, layout: HybridLayout, tp_rank: int, cfg: StorageConfig | None = None
) -> Namespace:
    """Model *weights* identity + layout (+ this worker's TP rank): see weights_identity."""
    from himamba.connector.weights_identity import weights_identity

    identity = weights_identity(
        vllm_config,
        mode=getattr(cfg, "weights_fingerprint", "sampled"),
        weights_id=getattr(cfg, "weights_id", None),
    )
    par = vllm_config.parallel_config
    algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256")
    fingerprint = LayoutFingerprint(
        block_size=layout.block_size,
        # The layout fingerprint already hashes every group's dtypes and shapes.
        kv_dtype=f"{layout.fingerprint}:{algo}",
        kv_shape=(layout.kv_slot_bytes,),
        mamba_dtypes=(),
        mamba_shapes=((layout.mamba_slot_bytes,),),
        tp_rank=tp_rank,
        tp_size=par.tensor_parallel_size,
        kernel_layout=str(layout.hash_block_size),
    )
    return Namespace(model=identity, layout=fingerprint)


def open_store(cfg: StorageConfig, namespace: Namespace) -> ByteStore:
    from himamba.tiers.lmcache_store import LMCacheStore

    store = LMCacheStore(cfg, namespace)
    logger.info("himamba: storage tier %s (namespace %s)", cfg.target, namespace.model_tag())
    return store


def acking_workers(parallel_config: ParallelConfig) -> int:
    """How many workers acknowledge each storage fetch to this engine's scheduler half (and
    report each storage write): the workers whose outputs vLLM hands this engine.

    That is the TP group (PP and PCP are refused by the layout), whatever data parallelism
    runs beside it, except under ``external_launcher``: there every process is an engine of
    its own with exactly one worker (vLLM's executor then runs no output aggregation), while
    ``parallel_config.world_size`` counts every rank of every DP replica. Waiting for that
    many acknowledgements would expire every fetch."""
    if getattr(parallel_config, "distributed_executor_backend", None) == "external_launcher":
        return 1
    return max(1, int(parallel_config.tensor_parallel_size))
