"""Run-time storage switches, prepared and retired off the engine loop.

Both connector roles run inside vLLM's engine loop: the scheduler half in the engine core's
step, the worker half in the worker's step, and a ``collective_rpc`` between two steps of that
same loop. Opening a store is slow (its namespace fingerprints the checkpoint, every byte of it
with ``weights_fingerprint: full``; the LMCache adapter connects) and closing one is slower (the
store's driver finishes its adapter call, pending writes land, the adapter closes with no bound
of its own). None of that may stall a step, and none of it may take the engine down. So a
switch is

* **prepared** on a background thread (``StoreSwitch.prepare``): the storage section is checked
  first, on the caller's thread, so a typo is the caller's error naming the field; the namespace
  and the store are built on the thread;
* **made** at a step boundary once the preparation is done, found by a cheap check of its
  future: the new store replaces the old one in one assignment;
* **refused** when the preparation failed: logged, reported by ``status`` (workers) and counted
  in ``stats()`` (scheduler); the role keeps serving with the store it had;
* **retired**: the old store is closed on another background thread; shutdown waits a bounded
  time for those closes, so their last writes can land.

The workers switch first (each rank when its own store is open) and report the switch in their
per-step metadata; the scheduler half then prepares its probe store and switches when that one
is open. Until then it plans fetches as before; a rank that already switched serves them from
its new store or fails them, and a failed fetch is rolled back: a miss, never a wrong byte
(every object is validated against its namespace and checksum where it is read).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from himamba.connector.protocol import ControlAction, ControlRequest, FetchAck
from himamba.connector.storage_setup import open_store, storage_config, storage_namespace
from himamba.tiers.storage_config import StorageConfig
from himamba.tiers.thread_priority import lower_current_thread

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long shutdown waits for retired stores to finish closing (each close bounds its own
# steps too; this bounds them all together).
CLOSE_WAIT_S = 10.0


def in_background(fn: Callable[[], T], name: str, nice: int = 0) -> Future[T]:
    """``fn`` on a new daemon thread (a hung adapter must never keep the process alive), at
    niceness ``nice``; its result or exception in the future."""
    fut: Future[T] = Future()

    def run() -> None:
        lower_current_thread(nice)
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the owner of the future
            fut.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def open_namespaced(
    cfg: StorageConfig, namespace: Callable[[], Any], open_cfg: StorageConfig
) -> Any:
    """Build the namespace on a thread at the store's niceness (the fingerprint is background
    work), then open the store on the calling thread: threads inherit their creator's
    niceness, and a store's own threads must run at ``open_cfg.thread_nice``, not lower."""
    ns = in_background(namespace, "himamba-fingerprint", cfg.thread_nice).result()
    return open_store(open_cfg, ns)


@dataclass(frozen=True)
class Prepared:
    """A store opened for ``cfg``; ``section`` as the caller gave it (None: the configured
    one), for the report to the scheduler half."""

    cfg: StorageConfig
    section: dict[str, Any] | None
    store: Any


@dataclass
class _Preparing:
    cfg: StorageConfig
    section: dict[str, Any] | None
    future: Future[Any]


class StoreSwitch:
    """One role's store in preparation, its last refusal, and the stores it is retiring.

    Only the engine loop's thread calls its methods; the futures (and the retiring list, under
    its lock) are all it shares with the background threads."""

    def __init__(self, owner: str) -> None:
        self.owner = owner  # "scheduler", "worker 0": names threads and log lines
        self.refusal: str | None = None
        self.refusals = 0
        self._preparing: _Preparing | None = None
        self._closing: list[Future[None]] = []
        self._lock = threading.Lock()

    @property
    def preparing(self) -> StorageConfig | None:
        return None if self._preparing is None else self._preparing.cfg

    def prepare(
        self, cfg: StorageConfig, section: dict[str, Any] | None, opener: Callable[[], Any]
    ) -> None:
        """Start opening a store (``opener``) on a background thread; one still in
        preparation is abandoned."""
        self.abandon()
        future = in_background(opener, f"himamba-open-{self.owner.replace(' ', '')}")
        self._preparing = _Preparing(cfg, section, future)

    def abandon(self) -> None:
        """Forget the store in preparation; it is closed once it is open."""
        pending, self._preparing = self._preparing, None
        if pending is not None:
            pending.future.add_done_callback(self._retire_result)

    def _retire_result(self, fut: Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.retire(fut.result().close, "an abandoned store")

    def take_ready(self) -> Prepared | None:
        """The prepared store once it is open (a cheap check: call it every step). A failed
        preparation becomes a refusal, logged once."""
        pending = self._preparing
        if pending is None or not pending.future.done():
            return None
        self._preparing = None
        exc = pending.future.exception()
        if exc is not None:
            self.refuse(pending.cfg, exc)
            return None
        self.refusal = None
        return Prepared(pending.cfg, pending.section, pending.future.result())

    def refuse(self, cfg: StorageConfig | None, exc: BaseException) -> None:
        """An attach that cannot be made: logged, counted and kept for ``status``."""
        what = "a storage section" if cfg is None else cfg.target
        self.refusal = f"attaching {what} failed: {type(exc).__name__}: {exc}"
        self.refusals += 1
        logger.warning("himamba: %s keeps its storage: %s", self.owner, self.refusal)

    def retire(self, close: Callable[[], None], what: str) -> None:
        """Close an old store on a background thread."""

        def run() -> None:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - a failed close only leaks its threads
                logger.warning("himamba: %s: closing %s failed: %s", self.owner, what, exc)

        future = in_background(run, f"himamba-close-{self.owner.replace(' ', '')}")
        with self._lock:
            self._closing = [f for f in self._closing if not f.done()] + [future]

    def closing(self) -> int:
        """Retired stores still closing."""
        with self._lock:
            return sum(not f.done() for f in self._closing)

    def shutdown(self, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Abandon any preparation and wait (bounded) for retired stores to close."""
        self.abandon()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            closing = list(self._closing)
        for fut in closing:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - a timeout: that close goes on in its thread
                pass
        return self.closing() == 0


# -- scheduler role ----------------------------------------------------------------------


class SchedulerControl:
    """The scheduler half's side: follows the storage switches its workers report.

    ``events`` (a ``KVEventTracker``, set when vLLM publishes KV events) hears of every switch:
    its storage medium follows the attached store."""

    def __init__(
        self,
        half: Any,
        vllm_config: Any,
        layout: Any,
        configured: StorageConfig | None,
        acking_workers: int,
    ) -> None:
        self.half = half
        self.vllm_config = vllm_config
        self.layout = layout
        self.configured = configured
        self.acking_workers = acking_workers
        self.events: Any = None
        self.switch = StoreSwitch("scheduler")

    def open_store(self, cfg: StorageConfig) -> Any:
        """The probe store: rank 0's namespace (a shard missing on another rank fails that
        fetch there, which the ledger rolls back). Probes sit on every new request's critical
        path, so its threads keep the engine's priority; ``thread_nice`` is for the workers'
        stores, whose work is mostly writes."""
        return open_namespaced(
            cfg,
            lambda: storage_namespace(self.vllm_config, self.layout, 0, cfg),
            replace(cfg, thread_nice=0),
        )

    def attach(self, cfg: StorageConfig, store: Any) -> None:
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


# -- worker role ---------------------------------------------------------------------------


class WorkerControl:
    """One worker's side: the ``himamba_control`` calls, and the switches they start."""

    def __init__(
        self, worker: Any, vllm_config: Any, layout: Any, configured: StorageConfig | None
    ) -> None:
        self.worker = worker
        self.vllm_config = vllm_config
        self.layout = layout
        self.configured = configured
        self.current: StorageConfig | None = None
        self.switch = StoreSwitch(f"worker {worker.rank}")
        # Acknowledgements of fetches a retired store was running (failed: slots go back).
        self._acks: list[FetchAck] = []
        # The scheduler half's planner in the last plan seen (0: it has no storage), the one
        # seen when the pending attach was asked for, and the switch the scheduler half has not
        # followed yet: (action, its planner before it heard of the switch). "When asked", as
        # another rank's earlier switch may have been followed already; when no plan was seen
        # by then, the plan of the step whose output carries the report.
        self._planner: int | None = None
        self._asked_at: int | None = None
        self._awaiting: tuple[ControlAction, int | None] | None = None

    def opener(self, cfg: StorageConfig, store: Any = None) -> Callable[[dict], Any]:
        """What ``WorkerHalf.attach_storage`` calls with its host pools (at start-up the store
        is opened there, once ``register_kv_caches`` made the pools)."""
        from himamba.connector.worker.worker_storage import WorkerStorage

        rank = self.worker.rank
        capacity = None if cfg.capacity_gb is None else int(cfg.capacity_gb * (1 << 30))

        def open_storage(pools: dict) -> WorkerStorage:
            s = self.open_store(cfg) if store is None else store
            return WorkerStorage(s, pools, rank, capacity, cfg.write_policy)

        return open_storage

    def open_store(self, cfg: StorageConfig) -> Any:
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
                self._asked_at = self._planner
                self.switch.prepare(cfg, section, lambda: self.open_store(cfg))
        elif action is ControlAction.DETACH:
            self.switch.abandon()
            self._retire_current()
            self.current = None
            self._report(ControlRequest(ControlAction.DETACH), self._planner)
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
            action, before = self._awaiting
            if action is ControlAction.DETACH:
                followed = seen == 0
            else:  # ``before`` is None until the report went out
                followed = before is not None and seen not in (None, 0, before)
            if not followed:
                return "switching"
            self._awaiting = None
        if seen is None:
            return "unknown"
        return "attached" if seen else "detached"

    # -- step boundaries --------------------------------------------------------------------
    def saw_planner(self, planner: int) -> None:
        """The planner id of the plan this step runs."""
        self._planner = planner

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
            self._report(ControlRequest(ControlAction.DETACH), self._planner)
            return
        self.current = ready.cfg
        section = json.dumps(ready.section) if ready.section else ""
        self._report(ControlRequest(ControlAction.ATTACH, section), self._asked_at)
        logger.info("himamba: rank %d attached storage %s", self.worker.rank, ready.cfg.target)

    def _report(self, request: ControlRequest, planner_before: int | None) -> None:
        self.worker.control_out.append(request)
        self._awaiting = (request.action, planner_before)

    def take_reports(self) -> list[ControlRequest]:
        """The switches to report in this step's output (``build_connector_worker_meta``)."""
        reports, self.worker.control_out = self.worker.control_out, []
        if reports and self._awaiting is not None and self._awaiting[1] is None:
            self._awaiting = (self._awaiting[0], self._planner)
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
