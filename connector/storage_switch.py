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

This module is the mechanism both roles share; each role's side of the protocol lives in its
own room: ``scheduler/storage_control.py`` (``SchedulerControl``, follows the workers' reports)
and ``worker/storage_control.py`` (``WorkerControl``, the ``himamba_control`` calls).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from himamba.connector.storage_setup import open_store
from himamba.tiers.byte_store import ByteStore
from himamba.tiers.object_format import Namespace
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
    cfg: StorageConfig, namespace: Callable[[], Namespace], open_cfg: StorageConfig
) -> ByteStore:
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
    store: ByteStore


@dataclass
class _Preparing:
    cfg: StorageConfig
    section: dict[str, Any] | None
    future: Future[ByteStore]


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
        self,
        cfg: StorageConfig,
        section: dict[str, Any] | None,
        opener: Callable[[], ByteStore],
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

    def _retire_result(self, fut: Future[ByteStore]) -> None:
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
