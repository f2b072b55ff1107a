"""What one stored block and one stored Mamba boundary look like, derived from vLLM's KV config.

Both connector roles build this from the same ``KVCacheConfig``: the scheduler
needs slot counts to allocate, the worker needs byte offsets to copy. Deriving
both from one function keeps the two processes in agreement without messages.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from himamba.tiers.cpu_pool import split_slots

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class UnsupportedLayout(RuntimeError):
    """The model's KV layout is one this connector cannot cache correctly."""


@dataclass(frozen=True)
class GroupLayout:
    group_id: int
    kind: str  # "attention" | "mamba"
    layer_names: tuple[str, ...]
    # Bytes of one block of one layer that carry data (padding excluded).
    layer_block_bytes: int


@dataclass(frozen=True)
class HybridLayout:
    block_size: int
    hash_block_size: int
    attention: tuple[GroupLayout, ...]
    mamba: tuple[GroupLayout, ...]
    num_gpu_blocks: int
    # Stable description of everything that changes the bytes of a slot.
    fingerprint: str

    @property
    def hashes_per_block(self) -> int:
        return self.block_size // self.hash_block_size

    @property
    def kv_slot_bytes(self) -> int:
        return sum(len(g.layer_names) * g.layer_block_bytes for g in self.attention)

    @property
    def mamba_slot_bytes(self) -> int:
        return sum(len(g.layer_names) * g.layer_block_bytes for g in self.mamba)

    def slot_counts(self, cpu_bytes: int, mamba_fraction: float) -> tuple[int, int]:
        """Split a byte budget into (KV slots, Mamba slots); both at least 1. The workers'
        spare slots (for in-place storage reads, `cpu_pool.spare_slots`) come out of it."""
        mamba_bytes = int(cpu_bytes * mamba_fraction)
        kv_slots = max(1, (cpu_bytes - mamba_bytes) // self.kv_slot_bytes)
        mamba_slots = max(1, mamba_bytes // self.mamba_slot_bytes)
        return split_slots(int(kv_slots)), split_slots(int(mamba_slots))


def _refuse_unsupported_parallelism(par: ParallelConfig) -> None:
    """Pipeline and context parallelism change what one block id means on one worker.

    With PP each stage owns other layers, so slot sizes differ per stage while the scheduler sizes
    the shared slot index from stage 0 (a larger stage would index past its pool, a stage without
    attention has no KV at all); with DCP/PCP attention blocks are token-sharded across ranks and
    the scheduler block is not the worker's. Until those are modelled, the connector stays inert.
    """
    for name, what in (
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("decode_context_parallel_size", "decode context parallelism (DCP)"),
        ("prefill_context_parallel_size", "prefill context parallelism (PCP)"),
    ):
        size = int(getattr(par, name, 1) or 1)
        if size > 1:
            raise UnsupportedLayout(
                f"{what} ({name}={size}) is not supported yet; use tensor parallelism"
            )


def build_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> HybridLayout:
    """Classify KV groups and check the model is one we can cache exactly.

    Raises UnsupportedLayout with the reason: the connector then stays inert
    (no hits, no stores) instead of risking a KV-only hybrid hit.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    if kv_cache_config is None:
        raise UnsupportedLayout("no kv_cache_config was passed to the connector")
    _refuse_unsupported_parallelism(vllm_config.parallel_config)
    attention: list[GroupLayout] = []
    mamba: list[GroupLayout] = []
    block_sizes: set[int] = set()
    parts: list[str] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue
        spec = group.kv_cache_spec
        names = tuple(group.layer_names)
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align":
                raise UnsupportedLayout(
                    f"Mamba group {gid} uses mamba_cache_mode={spec.mamba_cache_mode!r}; "
                    "prefix states exist only with 'align' (start vLLM with "
                    "--enable-prefix-caching)"
                )
            if spec.num_speculative_blocks:
                raise UnsupportedLayout("speculative decoding with Mamba is not supported yet")
            mamba.append(GroupLayout(gid, "mamba", names, int(spec.real_page_size_bytes)))
            parts.append(f"m{gid}:{spec.shapes}:{[str(d) for d in spec.dtypes]}:{spec.mamba_type}")
        elif isinstance(spec, FullAttentionSpec) and type(spec).__name__ in (
            "FullAttentionSpec",
            "MLAAttentionSpec",
        ):
            attention.append(GroupLayout(gid, "attention", names, int(spec.real_page_size_bytes)))
            parts.append(
                f"a{gid}:{type(spec).__name__}:{spec.num_kv_heads}:{spec.head_size}:"
                f"{getattr(spec, 'head_size_v', spec.head_size)}:{spec.dtype}"
            )
        else:
            raise UnsupportedLayout(
                f"KV group {gid} has {type(spec).__name__}; only full attention and "
                "Mamba (align) groups are supported"
            )
        block_sizes.add(int(spec.block_size))
    if not attention or not mamba:
        raise UnsupportedLayout(
            "not a hybrid model (needs at least one full-attention and one Mamba group)"
        )
    if len(block_sizes) != 1:
        raise UnsupportedLayout(f"KV groups disagree on block size: {sorted(block_sizes)}")
    block_size = block_sizes.pop()
    hash_bs = (
        getattr(kv_cache_config, "hash_block_size", None)
        or getattr(vllm_config.cache_config, "hash_block_size", None)
        or block_size
    )
    if block_size % hash_bs:
        raise UnsupportedLayout(f"block size {block_size} is not a multiple of hash {hash_bs}")
    par = vllm_config.parallel_config
    parts.append(
        f"bs{block_size}:tp{par.tensor_parallel_size}:pp{par.pipeline_parallel_size}:"
        f"layout{getattr(kv_cache_config, 'kv_cache_layout', None)}"
    )
    fingerprint = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return HybridLayout(
        block_size=block_size,
        hash_block_size=int(hash_bs),
        attention=tuple(attention),
        mamba=tuple(mamba),
        num_gpu_blocks=int(kv_cache_config.num_blocks),
        fingerprint=fingerprint,
    )
