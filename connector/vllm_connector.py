"""HiMambaConnector: the vLLM KV-connector entry point (both roles).

Thin glue: vLLM calls land here and are forwarded to the scheduler half or the
worker half; the two meet only through ``HiMambaMetadata`` (a StepPlan).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from himamba.connector.config import HiMambaConfig
from himamba.connector.jobs import StepPlan
from himamba.connector.layout import HybridLayout, UnsupportedLayout, build_layout
from himamba.connector.scheduler_side import SchedulerHalf
from himamba.connector.stats import HiMambaStats
from himamba.connector.worker_side import WorkerHalf

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("himamba")

try:  # vLLM >= 0.32 splits external hits by tier for metrics.
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]


@dataclass
class HiMambaMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


class HiMambaConnector(KVConnectorBase_V1, SupportsHMA):
    """Tiered prefix cache for hybrid attention + Mamba models."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: Any = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.config = HiMambaConfig.from_extra_config(extra)
        self.layout: HybridLayout | None = None
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        self._reported: dict[str, float] = {}
        try:
            self.layout = build_layout(vllm_config, kv_cache_config)
        except UnsupportedLayout as exc:
            logger.warning("himamba: caching disabled for this model: %s", exc)
            return
        kv_slots, mamba_slots = self.layout.slot_counts(
            self.config.cpu_cache_bytes, self.config.mamba_cache_fraction
        )
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerHalf(self.layout, self.config, kv_slots, mamba_slots)
        else:
            self.worker = WorkerHalf(self.layout, kv_slots, mamba_slots)

    # A dropped save is a future miss, never a correctness problem.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- scheduler role -------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        return self.scheduler.lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.scheduler is not None:
            self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.scheduler is None:
            return HiMambaMetadata()
        return HiMambaMetadata(plan=self.scheduler.build_plan(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.on_output(
                connector_output.finished_recving or (),
                getattr(connector_output, "failed_recving", None) or (),
            )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        if self.scheduler is not None:
            self.scheduler.on_finished(request)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        return self.request_finished(request, [])

    def reset_cache(self) -> bool | None:
        if self.scheduler is not None:
            return self.scheduler.reset()
        return True

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        if not num_external_tokens or CacheHitSource is None:
            return {}
        return {CacheHitSource.HOST: num_external_tokens}

    # -- worker role ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.worker is not None:
            self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, HiMambaMetadata)
            self.worker.run_loads(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, HiMambaMetadata)
            self.worker.run_stores(meta.plan)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        if self.worker is None:
            return KVConnectorTransferResults()
        finished, failed = self.worker.take_results()
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_kv_connector_stats(self) -> HiMambaStats | None:
        if self.worker is None:
            return None
        current = dict(self.worker.counters)
        delta = {k: v - self._reported.get(k, 0) for k, v in current.items()}
        self._reported = current
        return HiMambaStats.from_counters(delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HiMambaStats:
        return HiMambaStats(data=dict(data or {}))

    # -- introspection (tests, demo) ---------------------------------------------------
    def stats(self) -> dict[str, Any]:
        if self.scheduler is not None:
            return self.scheduler.stats()
        if self.worker is not None:
            return dict(self.worker.counters)
        return {}
