"""The scheduler half's side of run-time storage switches (``connector.storage_switch``).

The workers switch first and report it in their per-step metadata; this side follows each
report: it prepares its own probe store off the engine loop and swaps planners at a step
boundary once that store is open.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from himamba.connector.layout import HybridLayout
from himamba.connector.protocol import ControlAction, ControlRequest
from himamba.connector.storage_setup import storage_config, storage_namespace
from himamba.connector.storage_switch import StoreSwitch, open_namespaced
from himamba.tiers.byte_store import ByteStore
from himamba.tiers.storage_config import StorageConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from himamba.connector.observability.kv_events import KVEventTracker
    from himamba.connector.scheduler.scheduler_half import SchedulerHalf

logger = logging.getLogger(__name__)


class SchedulerControl:
    """The scheduler half's side: follows the storage switches its workers report.

    ``events`` (a ``KVEventTracker``, set when vLLM publishes KV events) hears of every switch:
    its storage medium follows the attached store."""

    def __init__(
        self,
        half: SchedulerHalf,
        vllm_config: VllmConfig,
        layout: HybridLayout,
        configured: StorageConfig | None,
        acking_workers: int,
    ) -> None:
        self.half = half
        self.vllm_config = vllm_config
        self.layout = layout
        self.configured = configured
        self.acking_workers = acking_workers
        self.events: KVEventTracker | None = None
        self.switch = StoreSwitch("scheduler")

    def open_store(self, cfg: StorageConfig) -> ByteStore:
        """The probe store: rank 0's namespace (a shard missing on another rank fails that
        fetch there, which the ledger rolls back). Probes sit on every new request's critical
        path, so its threads keep the engine's priority; ``thread_nice`` is for the workers'
        stores, whose work is mostly writes."""
        return open_namespaced(
            cfg,
            lambda: storage_namespace(self.vllm_config, self.layout, 0, cfg),
            replace(cfg, thread_nice=0),
        )

    def attach(self, cfg: StorageConfig, store: ByteStore) -> None:
        """Use ``store`` from now on; the planner it replaces closes in the background."""
        self._detach()
        half = self.half
        half.attach_storage(half.new_planner(cfg, store, self.acking_workers))
        if self.events is not None:
            self.events.storage_attached(cfg)

    def _detach(self) -> bool:
        planner = self.half.storage
        if planner is None or not self.half.detach_storage(close_store=False):
            return False
        self.switch.retire(planner.store.close, "the probe store")
        if self.events is not None:
            self.events.storage_detached()
        return True

    def on_requests(self, requests: list[ControlRequest]) -> None:
        """The workers' switches reported in this step's output (each rank reports its own,
        possibly in different steps: following one twice is a no-op)."""
        for req in requests:
            if req.action is ControlAction.DETACH:
                self.switch.abandon()
                if self._detach():
                    logger.info("himamba: storage detached at run time")
            elif req.action is ControlAction.ATTACH:
                self._follow_attach(req)

    def _follow_attach(self, req: ControlRequest) -> None:
        try:
            section = req.storage()
            cfg = storage_config(section) if section else self.configured
        except ValueError as exc:  # the workers accepted it: an environment that differs here
            self.switch.refuse(None, exc)
            return
        if cfg is None or cfg == self.switch.preparing:
            return
        current = self.half.storage
        if self.switch.preparing is None and current is not None and current.cfg == cfg:
            return
        self.switch.prepare(cfg, section, lambda: self.open_store(cfg))

    def poll(self) -> None:
        """At a step boundary: switch if the store in preparation is open."""
        ready = self.switch.take_ready()
        if ready is None:
            return
        try:
            self.attach(ready.cfg, ready.store)
        except Exception as exc:  # noqa: BLE001 - a failed switch must not stop the engine
            self.switch.refuse(ready.cfg, exc)
            self.switch.retire(ready.store.close, "the refused store")
            return
        logger.info("himamba: storage attached at run time: %s", ready.cfg.target)

    def busy(self) -> bool:
        """A store is in preparation: vLLM should keep stepping until it is switched in."""
        return self.switch.preparing is not None

    def counters(self) -> dict[str, int]:
        return {
            "storage_attach_refused": self.switch.refusals,
            "storage_stores_closing": self.switch.closing(),
        }

    def shutdown(self) -> None:
        self.switch.shutdown()
