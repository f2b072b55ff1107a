"""Async byte store over one LMCache 0.5.6 L2 adapter, hardened for what those adapters lack.

Callers (scheduler: exists; worker: put/get) only enqueue; one driver thread owns the adapter,
and `poll()` hands back finished tasks, so vLLM's step loop never waits on storage. The work
is split in two halves that meet only on that thread (`driver.Driver`):

* `store_pipeline.TaskPipeline`: a task's way from submit to result (staging, size batches,
  adapter calls, checksums, validation, deadlines, bounded write buffer);
* `adapter_health.AdapterHealth`: which adapter is current and whether it may be used
  (circuit breaker, health probe, recreation, quarantine of a replaced adapter's buffers).

This module holds the public class (`byte_store.ByteStore` is its contract with the connector)
and the order in which closing takes it apart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .adapter_health import AdapterHealth, create_lmcache_adapter
from .circuit_breaker import BreakerState
from .driver import Driver
from .object_format import Namespace, StorageKey
from .storage_config import StorageConfig
from .storage_records import OpKind, StoreStats, TaskError, TaskResult
from .store_pipeline import TaskPipeline

if TYPE_CHECKING:
    from .byte_store import ByteStore

__all__ = [
    "LMCacheStore",
    "OpKind",
    "StoreStats",
    "TaskError",
    "TaskResult",
    "create_lmcache_adapter",
]

log = logging.getLogger(__name__)
# How long close() waits for the driver's current step, and for replaced adapters to finish
# closing (their buffers are freed then; a slower one frees them whenever it finishes).
_DRIVER_STOP_S = 10.0
_OLD_ADAPTERS_CLOSE_S = 5.0


class LMCacheStore:
    """Non-blocking put / get / exists / delete of exact-size objects keyed by `StorageKey`."""

    def __init__(
        self,
        cfg: StorageConfig,
        namespace: Namespace,
        adapter_factory: Callable[[dict[str, Any]], Any] | None = None,
    ) -> None:
        self.cfg, self.ns = cfg, namespace
        self.stats = StoreStats()
        self._closed = False
        self._driver = Driver(self._step, lambda: self._health.fds, cfg.thread_nice)
        # Looked up at call time, not bound as a default argument, so a fault-injection test can
        # replace the module's factory.
        factory = adapter_factory or create_lmcache_adapter
        self._health = AdapterHealth(cfg, factory, self.stats, self._driver.post)
        self._pipeline = TaskPipeline(cfg, namespace, self._health, self.stats, self._driver.post)
        self._health.attach(self._pipeline)
        try:
            self._health.open()
        except BaseException:
            self._driver.stop(0)
            self._pipeline.stop_workers()
            self._pipeline.fail_unfinished()
            self._driver.close()
            raise
        self._driver.start()

    # ------------------------------------------------------------------ public API
    def submit_put(self, keys: Sequence[StorageKey], payloads: Sequence[Any]) -> int:
        """Store `payloads[i]` under `keys[i]`; returns a task id for `poll`/`wait`.

        A payload is a contiguous CPU buffer (tensor / array / bytes, any dtype) or a
        list/tuple of them, stored concatenated. They are copied before this returns, so the
        caller may reuse them at once. If the write buffer (`write_buffer_mb`) cannot take
        the whole put, nothing is stored: the task completes with error BACKPRESSURE."""
        return self._pipeline.submit_put(keys, payloads)

    def submit_put_later(
        self, keys: Sequence[StorageKey], payloads: Sequence[Any]
    ) -> tuple[int, Callable[[], None] | None]:
        """`submit_put` whose copy into the write buffer the caller runs later, on a thread of
        its choice (the payloads must stay unchanged until then); None when the put already
        failed (BACKPRESSURE, breaker open), with its result reported as for `submit_put`."""
        return self._pipeline.submit_put_later(keys, payloads)

    def submit_get(self, keys: Sequence[StorageKey], dsts: Sequence[Any]) -> int:
        """Load into dsts of the exact payload size; a key's dst is written only if it validates
        (and never after its task was reported).

        A dst may instead be an `ObjectView` (room for the whole object, header first): the
        adapter reads straight into it, with no staging copy, and the bytes are checked in
        place; ok[i] says they are valid. The adapter may still write into lent views after
        the task was reported (deadline, cancel, close): then its result says `held`, and
        the views are the store's until `take_released()` returns the task id."""
        return self._pipeline.submit(OpKind.GET, keys, dsts)

    def cancel(self, task_id: int) -> bool:
        """Give a get up: when this returns nothing more is copied into its destinations
        (copies in progress are waited out), so they may be reused at once. True if it had
        `ObjectView`s the adapter still holds: those come back through `take_released`."""
        return self._pipeline.cancel(task_id)

    def take_released(self) -> list[int]:
        """Ids of tasks reported `held` whose lent `ObjectView`s the adapter let go of since
        the last call (it answered, or it was closed)."""
        return self._pipeline.lent.take_released()

    def submit_exists(self, keys: Sequence[StorageKey]) -> int:
        return self._pipeline.submit(OpKind.EXISTS, keys, None)

    def submit_delete(self, keys: Sequence[StorageKey]) -> int:
        return self._pipeline.submit(OpKind.DELETE, keys, None)

    def poll(self) -> list[TaskResult]:
        """All tasks finished since the last call (never blocks on storage)."""
        return self._pipeline.poll()

    def wait(self, task_id: int, timeout_s: float | None = None) -> TaskResult | None:
        """Block for one task (tests, benchmarks, shutdown paths; not for the step loop)."""
        return self._pipeline.wait(task_id, timeout_s)

    def report_slow(self, reason: str) -> None:
        """A request's wait on storage timed out. Counts as a breaker failure, so
        `breaker_failures` slow waits in a row open the breaker and later ops miss at once
        (a success slower than the shortest prefetch wait does not break the streak)."""
        if not self._closed:
            self._health.report_slow(reason)

    @property
    def breaker_state(self) -> BreakerState:
        return self._health.state

    def quarantined_buffers(self) -> int:
        """Staging buffers still lent to an adapter for tasks already reported finished."""
        return self._pipeline.held_for_finished_tasks() + self._health.quarantined_buffers()

    def metrics(self) -> dict[str, float]:
        """Counters (`StoreStats.as_metrics`) plus gauges of the store's current state."""
        out: dict[str, float] = dict(self.stats.as_metrics())
        budget = self._pipeline.budget
        out.update(
            write_buffer_bytes=budget.used,
            write_buffer_peak_bytes=budget.peak,
            write_buffer_limit_bytes=budget.limit,
            puts_queued=self._pipeline.puts_queued,
            quarantined_buffers=self.quarantined_buffers(),
            breaker_open=float(self._health.state is not BreakerState.CLOSED),
            breaker_cooldown_s=self._health.breaker.cooldown_s,
        )
        return out

    def object_key_string(self, key: StorageKey) -> str:
        """The adapter's key for `key` (fs: file name without '.data'; resp: the Redis key)."""
        return self._pipeline.shapes.key_string(key)

    def close(self) -> None:
        """Stop; unfinished tasks are reported as CLOSED. Idempotent.

        Once this returns, every view lent to the adapter has been released (`take_released`)
        unless a replaced adapter is still closing after `_OLD_ADAPTERS_CLOSE_S`: its buffers
        stay counted in `quarantined_buffers()` and are released when it finishes."""
        if self._closed:
            return
        self._closed = True
        self._pipeline.close_intake()
        if not self._driver.stop(_DRIVER_STOP_S):
            log.warning("storage driver still inside an adapter call; closing around it")
        self._pipeline.stop_workers()  # what they post now runs inline
        if self._health.allow():
            self._pipeline.delete_probe_key(self._health.probe_key, timeout_s=2)
        with self._driver.exclusive():
            self._pipeline.fail_unfinished()
        self._health.close(_OLD_ADAPTERS_CLOSE_S)  # their frees are posted: not under the lock
        with self._driver.exclusive():
            self._pipeline.release_pending()  # the adapter's threads are gone
        self._driver.close()

    def _step(self) -> None:
        """One driver round after the posted work: completions, put hand-off, clocks."""
        self._pipeline.collect()
        self._pipeline.dispatch_puts()
        self._pipeline.expire(time.monotonic())
        self._health.maintain(time.monotonic())


if TYPE_CHECKING:

    def _is_a_byte_store(store: LMCacheStore) -> ByteStore:
        return store  # a type checker proves LMCacheStore satisfies the connector's contract
