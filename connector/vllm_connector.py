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
from himamba.connector.layout import HybridLayout, UnsupportedLayout, build_layout
from himamba.connector.observability.kv_events import (
    KVEventTracker,
    events_enabled,
    group_kinds,
)
from himamba.connector.observability.metrics import HiMambaPromMetrics, HiMambaStats
from himamba.connector.observability.stats import SchedulerStats, WorkerStats
from himamba.connector.protocol import (
    ControlAction,
    HiMambaWorkerEvents,
    HiMambaWorkerMeta,
    StepPlan,
)
from himamba.connector.scheduler.scheduler_half import SchedulerHalf
from himamba.connector.scheduler.storage_control import SchedulerControl
from himamba.connector.storage_setup import acking_workers, storage_config
from himamba.connector.vllm_fixups.engine_config import (
    BlockSizeGuard,
    adapt_load_failure_policy,
    model_runner_v2,
    partial_tails_allowed,
    retain_decode_states,
)
from himamba.connector.vllm_fixups.runner_v2_hook import install_step_hook, step_hook_available
from himamba.connector.worker.ranks import worker_rank
from himamba.connector.worker.storage_control import WorkerControl
from himamba.connector.worker.worker_half import RunnerOrder, WorkerHalf

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("himamba")


def _adopt_vllm_logging() -> None:
    """Our lines (start-up changes, storage events) belong in vLLM's log with vLLM's format and
    level; Python's default would drop every INFO line. vLLM configures its ``vllm`` logger at
    import; the ``himamba`` loggers use the same handlers unless someone configured them."""
    ours, theirs = logging.getLogger("himamba"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


_adopt_vllm_logging()

try:  # vLLM >= 0.32 splits external hits by tier for metrics.
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]


@dataclass
class HiMambaMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


def _plan_of(metadata: KVConnectorMetadata | None) -> StepPlan | None:
    return metadata.plan if isinstance(metadata, HiMambaMetadata) else None


class HiMambaConnector(KVConnectorBase_V1, SupportsHMA):
    """Tiered prefix cache for hybrid attention + Mamba models."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _adopt_vllm_logging()  # vLLM has configured its logger by now
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.config = HiMambaConfig.from_extra_config(extra)
        self.storage_config = storage_config(self.config.storage)
        # Workers whose acknowledgements and storage outcomes reach this scheduler half.
        self._acking_workers = acking_workers(vllm_config.parallel_config)
        self.layout: HybridLayout | None = None
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        # Run-time storage control (connector.storage_switch, each role's storage_control).
        self._control: SchedulerControl | WorkerControl | None = None
        self._stats: SchedulerStats | WorkerStats | None = None
        self._events: KVEventTracker | None = None
        self._block_size_guard: BlockSizeGuard | None = None
        try:
            self.layout = build_layout(vllm_config, kv_cache_config)
        except UnsupportedLayout as exc:
            # One warning per engine (the scheduler role); every worker would repeat it.
            log = logger.warning if role == KVConnectorRole.SCHEDULER else logger.debug
            log("himamba: caching disabled (connector inert) for this model: %s", exc)
            return
        # Model Runner V2 writes a step's blocks before our first hook (runner_v2_hook).
        v2 = model_runner_v2(vllm_config)
        kv_slots, mamba_slots = self.layout.slot_counts(
            self.config.cpu_cache_bytes, self.config.mamba_cache_fraction
        )
        scfg = self.storage_config
        if role == KVConnectorRole.SCHEDULER:
            adapt_load_failure_policy(vllm_config, self.config)
            self._block_size_guard = BlockSizeGuard(vllm_config, self.layout.block_size)
            retain_decode_states(vllm_config, kv_cache_config, self.config, self.layout)
            self.config = partial_tails_allowed(vllm_config, self.config)
            self.scheduler = SchedulerHalf(self.layout, self.config, kv_slots, mamba_slots)
            if self.scheduler.tails is not None and v2:
                # Without V2's step-start hook, tails whose blocks a step hands out are lost
                # (asked only with tails on: it imports V2's runner into this process).
                self.scheduler.tails.blocks_written_first = not step_hook_available()
            control = SchedulerControl(
                self.scheduler, vllm_config, self.layout, scfg, self._acking_workers
            )
            if scfg is not None:  # at start-up a store that cannot open is a config error
                control.attach(scfg, control.open_store(scfg))
            self._control = control
        else:
            self.worker = WorkerHalf(self.layout, kv_slots, mamba_slots, None, worker_rank())
            self.worker.runner_order = RunnerOrder.of(v2, v2 and install_step_hook())
            self._control = WorkerControl(self.worker, vllm_config, self.layout, scfg)
            if scfg is not None:  # opened by register_kv_caches, once the host pools exist
                self._control.attach_at_start(scfg)
        self._init_observability(vllm_config, kv_cache_config)

    # A dropped save is a future miss, never a correctness problem.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- scheduler role -------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        return self.scheduler.lookup(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.scheduler is not None:
            self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.scheduler is None:
            return HiMambaMetadata()
        assert isinstance(self._control, SchedulerControl)
        self._control.poll()  # a store prepared since the last step is switched in here
        return HiMambaMetadata(plan=self.scheduler.build_plan(scheduler_output))

    def on_new_request(self, request: Request) -> None:
        if self._block_size_guard is not None:
            self._block_size_guard.check()
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._events is not None:
            self._absorb_worker_events(getattr(connector_output, "kv_cache_events", None))
        if self.scheduler is not None:
            assert isinstance(self._control, SchedulerControl)
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(meta, HiMambaWorkerMeta) and meta.control:
                self._control.on_requests(meta.control)
            self._control.poll()
            acks = meta.fetch_acks if isinstance(meta, HiMambaWorkerMeta) else ()
            self.scheduler.on_output(
                connector_output.finished_recving or (),
                getattr(connector_output, "failed_recving", None) or (),
                acks,
            )

    def has_pending_push_work(self) -> bool:
        # Keeps the engine stepping while storage fetches are in flight, so they are
        # acknowledged (or reclaimed) instead of holding host slots while the engine is idle,
        # and while a store is being prepared, so it is switched in when it is open.
        if self.scheduler is None:
            return False
        assert isinstance(self._control, SchedulerControl)
        return self.scheduler.has_pending_work() or self._control.busy()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        if self.scheduler is not None:
            self.scheduler.on_finished(request)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        """Never holds the blocks: a partial tail is copied in the next step's first worker
        hook, before vLLM can zero or reuse them (``handle_preemptions``)."""
        if self.scheduler is None:
            return False, None
        self.scheduler.keep_tail(request, block_ids)
        self.scheduler.on_finished(request)
        return False, None

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, called after weight updates:
        every tier, storage included, stops serving what was cached before."""
        if self.scheduler is None:
            return True
        done = self.scheduler.reset()
        if self._events is not None:
            self._events.storage_reset()  # the new key epoch hides every stored object
        return done

    def drop_host_tier(self) -> None:
        """Scheduler role: empty the CPU tier but keep storage reachable, as a restart would."""
        if self.scheduler is not None:
            self.scheduler.drop_host_tier()

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        if not num_external_tokens or CacheHitSource is None or self.scheduler is None:
            return {}
        host, disk = self.scheduler.hit_sources(request.request_id, num_external_tokens)
        out = {CacheHitSource.HOST: host, CacheHitSource.DISK: disk}
        return {k: v for k, v in out.items() if v}

    def build_connector_worker_meta(self) -> HiMambaWorkerMeta | None:
        if self.worker is None:
            return None
        assert isinstance(self._control, WorkerControl)
        self._control.poll()  # the step's last hook: a store prepared meanwhile goes live here
        acks = self.worker.take_acks() + self._control.take_acks()
        control = self._control.take_reports()
        return HiMambaWorkerMeta(acks, control) if acks or control else None

    # -- run-time storage control (connector.control, connector.storage_switch) -------------
    def control(self, action: ControlAction, storage: dict[str, Any] | None = None) -> dict:
        """Worker role, from ``HiMambaWorkerExtension.himamba_control``: start this worker's
        switch and answer its status at once. A new store is prepared in the background and
        goes live at a step boundary (``status`` then says ``attached``); the scheduler half
        follows when the worker reports it. A bad storage section raises, naming the field."""
        if self.worker is None:
            raise RuntimeError("himamba_control: the connector is inert for this model")
        assert isinstance(self._control, WorkerControl)
        return self._control.call(action, storage)

    def shutdown(self) -> None:
        if self._control is not None:
            self._control.shutdown()  # bounded wait for stores retired at run time
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None and self.scheduler.storage is not None:
            self.scheduler.storage.store.close()

    # -- worker role ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker is not None:
            self.worker.register(kv_caches)

    @property
    def step_hook_installed(self) -> bool:
        """This worker's runner calls ``himamba_step_start`` before it writes any block."""
        return self.worker is not None and self.worker.runner_order is RunnerOrder.STEP_HOOK

    def himamba_step_start(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Called by the Model Runner V2 hook (``runner_v2_hook``) before V2 zeroes or copies
        any block of the step: what ``handle_preemptions`` does under V1."""
        if self.step_hook_installed:
            assert self.worker is not None
            self.worker.step_start(_plan_of(kv_connector_metadata))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM's first worker hook of every step, before the forward. Model Runner V1 calls it
        # before it zeroes or copies any block: the last step's stores must have read their
        # source blocks by now, and so must this plan's partial tails (blocks vLLM freed when
        # the last output came in). V2 zeroes and copies first: there our step-start hook did
        # this already (or, without it, CPU stores finished within their own step and tails
        # whose blocks this step hands out are not in the plan).
        if self.worker is not None:
            self.worker.first_hook(_plan_of(kv_connector_metadata))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: object) -> None:
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, HiMambaMetadata) and isinstance(self._control, WorkerControl)
            self._control.saw_planner(meta.plan.generation.planner, meta.plan.storage_id)
            self.worker.run_loads(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: object,
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, HiMambaMetadata)
            self.worker.run_stores(meta.plan)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        if self.worker is None:
            return KVConnectorTransferResults()
        finished, failed = self.worker.take_results()
        return KVConnectorTransferResults(
            finished_recving=finished,
            failed_recving=failed,
        )

    # -- metrics and KV events (both roles) -----------------------------------------------
    def _init_observability(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
    ) -> None:
        """Stats sources for both roles; KV events only when vLLM publishes them (otherwise no
        tracker exists and the tree has no observer: no per-step cost)."""
        enabled = events_enabled(vllm_config)
        if self.worker is not None:
            self._stats = WorkerStats(self.worker)
            # Whether or not a store is attached now: one attached at run time reports too.
            self.worker.record_storage_events = enabled
            return
        if self.scheduler is None or self.layout is None:
            return
        self._stats = SchedulerStats(self.scheduler)
        if not enabled:
            return
        assert isinstance(self._control, SchedulerControl)
        tracker = KVEventTracker(
            self.layout, group_kinds(self.layout, kv_cache_config), self._acking_workers
        )
        if self.scheduler.storage is not None:
            tracker.storage_attached(self.scheduler.storage.cfg)
        self._control.events = tracker  # follows every later switch
        self._events = tracker
        self.scheduler.events = tracker
        self.scheduler.tree.set_observer(tracker)

    def get_kv_connector_stats(self) -> HiMambaStats | None:
        """This interval's deltas (scheduler: hits, CPU tier, occupancy; worker: copies and
        storage traffic); None when nothing changed. See ``connector.metrics``."""
        return None if self._stats is None else self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HiMambaStats:
        return HiMambaStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> HiMambaPromMetrics:
        return HiMambaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_kv_cache_events(self) -> HiMambaWorkerEvents | None:
        """Worker role: this step's storage outcomes, for the scheduler to announce."""
        storage = None if self.worker is None else self.worker.storage
        outcomes = None if storage is None else storage.outcomes
        if not outcomes:
            return None
        storage.outcomes = []  # type: ignore[union-attr]
        return HiMambaWorkerEvents(outcomes)

    def _absorb_worker_events(self, events: KVConnectorKVEvents | None) -> None:
        if isinstance(events, HiMambaWorkerEvents) and events.outcomes:
            assert self._events is not None and self.scheduler is not None
            storage = self.scheduler.storage
            self._events.absorb(events.outcomes, "" if storage is None else storage.epoch)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Scheduler role: our tiers' BlockStored / BlockRemoved events of this step, published
        by vLLM's own KV-event publisher with its GPU events (see ``connector.kv_events``)."""
        return () if self._events is None else self._events.take()

    # -- introspection (tests, demo) ---------------------------------------------------
    def leak_report(self) -> dict[str, int | bool]:
        """What this role still holds per request or per object (all zero once idle)."""
        if self.scheduler is not None:
            return self.scheduler.leak_report()
        if self.worker is not None:
            return self.worker.leak_report()
        return {}

    def stats(self) -> dict[str, float]:
        if self.scheduler is not None:
            assert isinstance(self._control, SchedulerControl)
            return {**self.scheduler.stats(), **self._control.counters()}
        if self.worker is not None:
            return self.worker.all_counters()
        return {}
