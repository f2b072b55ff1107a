"""One worker's side of run-time storage switches (``connector.storage_switch``).

``himamba_control`` calls land here between two steps: a switch is started and its status
answered at once; the new store goes live at a later step boundary, and the switch is reported
in the worker's per-step metadata for the scheduler half to follow.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from himamba.connector.layout import HybridLayout
from himamba.connector.protocol import ControlAction, ControlRequest, FetchAck
from himamba.connector.storage_setup import storage_config, storage_namespace
from himamba.connector.storage_switch import StoreSwitch, open_namespaced
from himamba.tiers.byte_store import ByteStore
from himamba.tiers.storage_config import StorageConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from himamba.connector.worker.worker_half import WorkerHalf
    from himamba.connector.worker.worker_storage import WorkerStorage
    from himamba.tiers.cpu_pool import HostSlotPool

logger = logging.getLogger(__name__)


class WorkerControl:
    """One worker's side: the ``himamba_control`` calls, and the switches they start."""

    def __init__(
        self,
        worker: WorkerHalf,
        vllm_config: VllmConfig,
        layout: HybridLayout,
        configured: StorageConfig | None,
    ) -> None:
        self.worker = worker
        self.vllm_config = vllm_config
        self.layout = layout
        self.configured = configured
        self.current: StorageConfig | None = None
        self.switch = StoreSwitch(f"worker {worker.rank}")
        # Acknowledgements of fetches a retired store was running (failed: slots go back).
        self._acks: list[FetchAck] = []
        # The scheduler half's planner in the last plan seen (0: it has no storage) and its
        # store's ``StorageConfig.identity()`` ("": none), and the switch of this rank the
        # scheduler half has not followed yet. An attach is followed once the scheduler half
        # runs on this rank's store, whichever rank's report it acted on: planner ids cannot
        # tell, as another rank's report of the same switch may have been followed first.
        self._planner: int | None = None
        self._scheduler_store = ""
        self._awaiting: ControlAction | None = None

    def opener(
        self, cfg: StorageConfig, store: ByteStore | None = None
    ) -> Callable[[dict[int, HostSlotPool]], WorkerStorage]:
        """What ``WorkerHalf.attach_storage`` calls with its host pools (at start-up the store
        is opened there, once ``register_kv_caches`` made the pools)."""
        # Looked up at each attach, not at import: tests stand a failing one in.
        from himamba.connector.worker.worker_storage import WorkerStorage

        rank = self.worker.rank
        capacity = None if cfg.capacity_gb is None else int(cfg.capacity_gb * (1 << 30))

        def open_storage(pools: dict[int, HostSlotPool]) -> WorkerStorage:
            s = self.open_store(cfg) if store is None else store
            return WorkerStorage(s, pools, rank, capacity, cfg.write_policy)

        return open_storage

    def open_store(self, cfg: StorageConfig) -> ByteStore:
        rank = self.worker.rank
        return open_namespaced(
            cfg, lambda: storage_namespace(self.vllm_config, self.layout, rank, cfg), cfg
        )

    def attach_at_start(self, cfg: StorageConfig) -> None:
        self.current = cfg
        self.worker.attach_storage(self.opener(cfg))

    # -- the control calls (between two steps of this worker) ----------------------------
    def call(self, action: ControlAction, section: dict[str, Any] | None) -> dict[str, Any]:
        self.poll()
        if action is ControlAction.ATTACH:
            cfg = storage_config(section) if section is not None else self.configured
            if cfg is None:
                raise ValueError(
                    "himamba_control: no storage is configured; pass a storage section "
                    '(e.g. {"url": "file:///path"}) as the second argument'
                )
            attached = self.worker.storage is not None and cfg == self.current
            if cfg != self.switch.preparing and not (attached and self.switch.preparing is None):
                self.switch.prepare(cfg, section, lambda: self.open_store(cfg))
        elif action is ControlAction.DETACH:
            self.switch.abandon()
            self._retire_current()
            self.current = None
            self._report(ControlRequest(ControlAction.DETACH))
        return self.status()

    def status(self) -> dict[str, Any]:
        """``storage``: this rank's store (``attaching`` while one is prepared); ``target``:
        that store; ``scheduler``: the scheduler half's, as its last plan showed
        (``switching`` until it follows this rank's last switch); ``error``: the last refused
        attach on this rank (None once one succeeded)."""
        preparing = self.switch.preparing
        if preparing is not None:
            state, target = "attaching", preparing.target
        elif self.worker.storage is not None and self.current is not None:
            state, target = "attached", self.current.target
        else:
            state, target = "detached", None
        return {
            "rank": self.worker.rank,
            "storage": state,
            "target": target,
            "scheduler": self._scheduler_state(),
            "error": self.switch.refusal,
        }

    def _scheduler_state(self) -> str:
        seen = self._planner
        if self._awaiting is not None:
            if self._awaiting is ControlAction.DETACH:
                followed = seen == 0
            else:
                mine = None if self.current is None else self.current.identity()
                followed = bool(seen) and self._scheduler_store == mine
            if not followed:
                return "switching"
            self._awaiting = None
        if seen is None:
            return "unknown"
        return "attached" if seen else "detached"

    # -- step boundaries --------------------------------------------------------------------
    def saw_planner(self, planner: int, storage_id: str = "") -> None:
        """The planner id of the plan this step runs, and its store's identity."""
        self._planner = planner
        self._scheduler_store = storage_id

    def poll(self) -> None:
        """Switch to the prepared store if it is open (a cheap check, every step)."""
        ready = self.switch.take_ready()
        if ready is None:
            return
        # A failed switch must not stop the worker: it keeps the old store if that is still
        # in place, else it reports a detach, so both halves agree it has none.
        try:
            self._retire_current()
        except Exception as exc:  # noqa: BLE001
            self.switch.refuse(ready.cfg, exc)
            self.switch.retire(ready.store.close, "the refused store")
            return
        try:
            self.worker.attach_storage(self.opener(ready.cfg, ready.store))
        except Exception as exc:  # noqa: BLE001
            self.switch.refuse(ready.cfg, exc)
            self.switch.retire(ready.store.close, "the refused store")
            self.worker.storage = None
            self.current = None
            self._report(ControlRequest(ControlAction.DETACH))
            return
        self.current = ready.cfg
        section = json.dumps(ready.section) if ready.section else ""
        self._report(ControlRequest(ControlAction.ATTACH, section))
        logger.info("himamba: rank %d attached storage %s", self.worker.rank, ready.cfg.target)

    def _report(self, request: ControlRequest) -> None:
        self.worker.control_out.append(request)
        self._awaiting = request.action

    def take_reports(self) -> list[ControlRequest]:
        """The switches to report in this step's output (``build_connector_worker_meta``)."""
        reports, self.worker.control_out = self.worker.control_out, []
        return reports

    def _retire_current(self) -> None:
        """Take the current store out of the worker half now, close it in the background."""
        worker = self.worker
        worker.settle()  # copies that completed reach the old store first (write-through)
        old, worker.storage = worker.storage, None
        worker.detach_storage()  # forgets the start-up opener; nothing is left to close
        if old is None:
            return
        self._acks += old.take_acks()
        self._acks += old.abort_fetches()
        # write_back: what only the host holds is copied out now, while the slots still hold
        # it (the close writes it in the background).
        old.flush_dirty()
        self.switch.retire(old.close, "the old store")

    def take_acks(self) -> list[FetchAck]:
        acks, self._acks = self._acks, []
        return acks

    def shutdown(self) -> None:
        self.switch.shutdown()
