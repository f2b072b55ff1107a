"""Adapter health: which LMCache adapter is current, whether it may be used, and its repair.

LMCache's adapters cannot be trusted to notice their own death: the native RESP client fails
fast while Redis is down, but never reconnects once it is back and still reports itself
healthy, and a size-mismatched reply desynchronises its connection for good. So health is
judged here, from outcomes (`outcome`), the scheduler's timed-out waits (`report_slow`) and a
periodic write-then-read probe, through a `CircuitBreaker`. The cure for a broken adapter is a
fresh one: `_recreate` swaps it in and keeps the old one's buffers ("quarantined") until the
old adapter is closed, because its native threads may still write into them. That close runs
on a thread of its own (it waits for the adapter's I/O) and posts the free to the driver,
which runs it even when the store closed meanwhile (`driver.Driver.post`).

Everything here runs on the store's driver thread (except `report_slow`); the task pipeline
(`TaskRunner`) executes the probe's ops and hands over its in-flight batches when the adapter
is replaced.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from .circuit_breaker import BreakerState, CircuitBreaker
from .object_format import ObjectKind, StorageKey
from .s3_bounds import bound_gets
from .storage_config import PrefetchPolicy, StorageConfig
from .storage_records import Batch, OpKind, StoreStats, Task, TaskError
from .valkey_lookup import batch_lookups

log = logging.getLogger(__name__)
_L2 = "lmcache.v1.distributed.l2_adapters"
PROBE_PAYLOAD = b"himamba\x01"
_MAX_DEFERRED_CHECKS = 4096  # keys; beyond, a damaged object is found at its next read


def create_lmcache_adapter(spec: dict[str, Any]) -> Any:
    """Build an L2 adapter, importing only its own module (the lazy loader would pull in
    aerospike, bigtable... first). `fs_native` falls back to pure-Python `fs` if its C++ lib fails."""
    t = spec["type"]
    try:
        importlib.import_module(f"{_L2}.{t.replace('-', '_')}_l2_adapter")
    except ImportError:
        pass  # plugins and odd names: LMCache's registry may still know the type
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

    try:
        adapter = create_l2_adapter_from_registry(get_l2_adapter_config_class(t).from_dict(spec))
    except (ImportError, RuntimeError):
        if t != "fs_native":
            raise
        log.warning("fs_native unavailable, using LMCache's pure-Python fs adapter", exc_info=True)
        fs = {"type": "fs", "base_path": spec["base_path"], "relative_tmp_dir": "tmp"}
        return create_lmcache_adapter(fs)
    if t == "valkey":
        batch_lookups(adapter)  # one pipelined EXISTS batch per probe (valkey_lookup.py)
    if t == "s3":
        try:
            bound_gets(adapter)  # no read past a buffer, no short object as whole (s3_bounds.py)
        except RuntimeError:
            adapter.close()
            raise
    return adapter


class TaskRunner(Protocol):
    """What health needs from the task pipeline."""

    def submit_internal(
        self,
        op: OpKind,
        keys: list[StorageKey],
        bufs: list[np.ndarray] | None,
        on_done: Callable[[Task, TaskError | None], None],
    ) -> None: ...

    def detach_batches(self) -> list[Batch]: ...

    def free_batches(self, batches: list[Batch]) -> None: ...


class AdapterHealth:
    """Owns the current adapter and the breaker that says whether ops may use it."""

    def __init__(
        self,
        cfg: StorageConfig,
        factory: Callable[[dict[str, Any]], Any],
        stats: StoreStats,
        post: Callable[[Callable[[], None]], None],
    ) -> None:
        self.cfg, self.stats = cfg, stats
        self._factory, self._post = factory, post
        self.breaker = CircuitBreaker(
            cfg.breaker_failures, cfg.breaker_cooldown_s, cfg.breaker_max_cooldown_s
        )
        self.adapter: Any = None
        self.fds: list[int] = []  # the adapter's completion eventfds, for the driver's select
        self._gen = 0
        self._quarantine: dict[int, list[Batch]] = {}  # adapter generation -> its batches
        self._closers: list[threading.Thread] = []  # closing replaced adapters
        self.probe_key = StorageKey(uuid.uuid4().bytes, ObjectKind.PROBE)
        self._probe_id = 0  # only the latest probe's answer counts
        self._probing = False
        self._last_probe = time.monotonic()
        self._deferred_deletes: list[StorageKey] = []
        # Keys a failed RESP load left unexplained (damaged object, or just gone?): looked up
        # on the fresh adapter, each with its callback.
        self._deferred_checks: list[tuple[list[StorageKey], Callable[..., None]]] = []
        # LMCache's RESP client leaves a size-mismatched reply unread: later replies on that
        # connection belong to earlier requests, so only a fresh adapter is trustworthy.
        self._desync_prone = cfg.adapter.get("type") == "resp"
        # A success slower than the shortest wait a request spends on storage is no evidence
        # that storage is fast enough: it must not reset a streak of slow waits.
        base = cfg.prefetch_timeout_base_s
        timely = (
            base
            if cfg.prefetch_policy is PrefetchPolicy.TIMEOUT and base > 0
            else cfg.op_deadline_s
        )
        self._timely_s = min(cfg.op_deadline_s, timely)
        self._runner: TaskRunner | None = None

    def attach(self, runner: TaskRunner) -> None:
        self._runner = runner

    def _create_adapter(self) -> Any:
        return self._factory(self.cfg.adapter)

    def open(self) -> None:
        """Create the first adapter. A bad spec raises; storage down at startup only opens
        the breaker (serving must not depend on storage)."""
        try:
            self._install(self._create_adapter())
        except ValueError:
            raise
        except Exception as e:
            log.warning("storage adapter unavailable at startup: %s", e)
            self._trip(f"create failed: {e}")

    # ------------------------------------------------------------------ verdicts
    @property
    def state(self) -> BreakerState:
        return self.breaker.state

    def allow(self) -> bool:
        """May a new op use the adapter? (Read from any thread: a plain attribute read.)"""
        return self.breaker.allow() and self.adapter is not None

    def outcome(self, ok: bool, reason: str, latency_s: float = 0.0) -> None:
        """One op's result. A late success neither counts for nor against the adapter."""
        if not ok:
            if self.breaker.record_failure(reason):
                self._opened(reason)
        elif latency_s <= self._timely_s:
            self.breaker.record_success()

    def report_slow(self, reason: str) -> None:
        """A request gave up waiting on storage: a failure, though every op may succeed.
        Called on the scheduler's thread (the breaker is thread-safe), not posted to the
        driver: a driver stuck in a slow adapter call must not delay the verdict."""
        self.stats.slow_reports += 1
        self.outcome(False, f"slow: {reason}")

    def defer_deletes(self, keys: list[StorageKey]) -> bool:
        """Bad objects are about to be deleted. While a RESP adapter is being replaced (a load
        failed on it: `op_failed`), hold the deletes for the fresh one; True if held."""
        if not self._resp_being_replaced():
            return False
        self._deferred_deletes.extend(keys)
        return True

    def op_failed(self, op: str) -> None:
        """A load or store failed on the adapter. On LMCache's RESP client that means one of
        its connections threw mid-reply: a size or trailer mismatch leaves the rest of the
        reply unread (every later reply on that connection is off by it), a refused SET
        (``-OOM ...``) leaves its error line, a dead socket stays dead; none reconnects.
        (A missing key does not fail a RESP GET: the worker waits for bytes that never come,
        which is a deadline.) So one failure replaces it now, before the caller hears of the
        miss; a streak would leave requests meeting the broken connection meanwhile."""
        if self._desync_prone and self.breaker.allow():
            self._trip(f"a {op} failed on a RESP connection")

    def _resp_being_replaced(self) -> bool:
        """A RESP adapter that may not be used now: ops wait for the fresh one's probe."""
        return self._desync_prone and not self.breaker.allow()

    def defer_check(self, keys: list[StorageKey], on_done: Callable[..., None]) -> bool:
        """Keys a failed load left unexplained, to look up once a fresh adapter is proven
        (the current one is being replaced); True if held."""
        if not self._resp_being_replaced():
            return False
        if sum(len(k) for k, _ in self._deferred_checks) < _MAX_DEFERRED_CHECKS:
            self._deferred_checks.append((keys, on_done))
        return True

    def quarantined_buffers(self) -> int:
        return sum(len(b.staging) for bs in list(self._quarantine.values()) for b in bs)

    # ------------------------------------------------------------------ driver-thread upkeep
    def maintain(self, now: float) -> None:
        state = self.breaker.state
        if state is BreakerState.OPEN and self.breaker.should_probe():
            if self._recreate():
                self._probe()
        elif state is BreakerState.CLOSED and not self._probing:
            if now - self._last_probe >= self.cfg.probe_interval_s:
                self._probe()

    def _trip(self, reason: str) -> None:
        if self.breaker.trip(reason):
            self._opened(reason)

    def _opened(self, reason: str) -> None:
        self.stats.breaker_opens += 1
        log.warning(
            "storage breaker open (%s); next probe in %.1f s", reason, self.breaker.cooldown_s
        )

    def _probe(self) -> None:
        """Write then read back a tiny object: the only way to see a silently dead RESP client."""
        assert self._runner is not None
        self._probe_id += 1
        pid, runner = self._probe_id, self._runner
        self._probing, self._last_probe = True, time.monotonic()
        payload = np.frombuffer(PROBE_PAYLOAD, dtype=np.uint8)
        dst = np.zeros(len(PROBE_PAYLOAD), dtype=np.uint8)

        def got(t: Task, err: TaskError | None) -> None:
            self._probe_done(pid, bool(err is None and t.ok[0] and bytes(dst) == PROBE_PAYLOAD))

        def stored(t: Task, err: TaskError | None) -> None:
            if err is not None or not t.ok[0]:
                return self._probe_done(pid, False)
            runner.submit_internal(OpKind.GET, [self.probe_key], [dst], got)

        runner.submit_internal(OpKind.PUT, [self.probe_key], [payload], stored)

    def _probe_done(self, pid: int, ok: bool) -> None:
        if pid != self._probe_id:
            return  # a probe of a replaced adapter, finished by the replacement
        self._probing, self._last_probe = False, time.monotonic()
        if ok:
            self.stats.probes_ok += 1
        else:
            self.stats.probes_failed += 1
        if self.breaker.state is BreakerState.PROBING:
            self.breaker.probe_result(ok)
            log.warning(
                "storage probe after recreate: %s",
                "recovered" if ok else f"still down, next in {self.breaker.cooldown_s:.1f} s",
            )
            if ok:
                self._run_deferred()
        elif not ok and self.breaker.allow():
            self._trip("health probe failed")

    def _run_deferred(self) -> None:
        """The fresh adapter passed its probe: the lookups and deletes held for it."""
        runner = self._runner
        assert runner is not None
        checks, self._deferred_checks = self._deferred_checks, []
        for keys, on_done in checks:
            runner.submit_internal(OpKind.EXISTS, keys, None, on_done)
        if self._deferred_deletes:
            keys, self._deferred_deletes = self._deferred_deletes, []
            runner.submit_internal(OpKind.DELETE, keys, None, lambda t, e: None)

    def _install(self, adapter: Any) -> None:
        self.adapter, self._gen = adapter, self._gen + 1
        self.fds = [
            adapter.get_store_event_fd(),
            adapter.get_lookup_and_lock_event_fd(),
            adapter.get_load_event_fd(),
        ]

    def _recreate(self) -> bool:
        """Swap in a fresh adapter; the old one is closed off-thread, its buffers held till then."""
        assert self._runner is not None
        old, gen, runner = self.adapter, self._gen, self._runner
        self.adapter, self.fds, self._probing = None, [], False
        self._quarantine[gen] = runner.detach_batches()

        def close_old() -> None:
            try:
                if old is not None:
                    old.close()
            except Exception:
                log.warning("closing old storage adapter failed", exc_info=True)
            # Its threads are gone: the buffers may be reused now.
            self._post(lambda: runner.free_batches(self._quarantine.pop(gen, [])))

        self._closers = [t for t in self._closers if t.is_alive()]
        closer = threading.Thread(target=close_old, name="himamba-l3-close", daemon=True)
        self._closers.append(closer)
        closer.start()
        try:
            self._install(self._create_adapter())
        except Exception as e:
            log.warning("recreating storage adapter failed: %s", e)
            self.breaker.probe_result(False, f"create failed: {e}")
            return False
        self.stats.adapter_recreations += 1
        return True

    def close(self, wait_old_s: float) -> None:
        """Wait up to `wait_old_s` for replaced adapters to finish closing (their buffers are
        freed as each does), then close the current one. The caller stopped the driver and
        finished all tasks, and holds no lock the frees need."""
        deadline = time.monotonic() + wait_old_s
        for t in self._closers:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._closers):
            log.warning(
                "a replaced storage adapter is still closing: %d buffers stay quarantined",
                self.quarantined_buffers(),
            )
        if self.adapter is not None:
            try:
                self.adapter.close()
            except Exception:
                log.warning("closing storage adapter failed", exc_info=True)
            self.adapter = None
