"""`ByteStore`: what the storage tier offers the connector, whatever holds the bytes.

The connector (scheduler: exists probes; worker: puts, gets, deletes) sees storage only
through this contract, so it never knows whether bytes sit on disk or in Redis, and a test
can stand a fake in for it. `lmcache_store.LMCacheStore` implements it over one LMCache L2
adapter.

Every `submit_*` only enqueues and returns a task id at once; its `TaskResult` comes back from
`poll()` (the step loop) or `wait()` (tests, shutdown). A task fails as a whole with a
`TaskError` member in `error` (compare with `is`); otherwise `ok[i]` is per key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from .circuit_breaker import BreakerState
from .object_format import StorageKey
from .storage_records import StoreStats, TaskResult


@runtime_checkable
class ByteStore(Protocol):
    """Non-blocking put / get / exists / delete of exact-size objects keyed by `StorageKey`."""

    @property
    def stats(self) -> StoreStats:
        """Monotonic counters (written by the store's own threads; read, never reset)."""
        ...

    @property
    def breaker_state(self) -> BreakerState:
        """CLOSED while storage may be used; otherwise ops miss at once."""
        ...

    def submit_put(self, keys: Sequence[StorageKey], payloads: Sequence[Any]) -> int:
        """Store `payloads[i]` (a contiguous CPU buffer, or a list of them stored back to back)
        under `keys[i]`. Copied before this returns: the caller may reuse them at once. A put
        the write buffer cannot take fails whole with `TaskError.BACKPRESSURE`."""
        ...

    def submit_put_later(
        self, keys: Sequence[StorageKey], payloads: Sequence[Any]
    ) -> tuple[int, Callable[[], None] | None]:
        """A put whose copy into store memory the caller runs later, on its own thread (the
        payloads stay unchanged until then); None when it already failed."""
        ...

    def submit_get(self, keys: Sequence[StorageKey], dsts: Sequence[Any]) -> int:
        """Load into `dsts` (each the exact payload size, or an `ObjectView` lent for the whole
        object); a dst is written only with bytes that validate, and never after the result.
        A result with `held` means lent views are still the store's until `take_released`."""
        ...

    def submit_exists(self, keys: Sequence[StorageKey]) -> int: ...

    def submit_delete(self, keys: Sequence[StorageKey]) -> int: ...

    def poll(self) -> list[TaskResult]:
        """Every task finished since the last call; never blocks on storage."""
        ...

    def wait(self, task_id: int, timeout_s: float | None = None) -> TaskResult | None:
        """Block for one task's result (None on timeout); not for the step loop."""
        ...

    def cancel(self, task_id: int) -> bool:
        """Give a get up: nothing is written into its dsts once this returns. True if lent
        views are still held (their release comes through `take_released`)."""
        ...

    def take_released(self) -> list[int]:
        """Ids of `held` tasks whose lent views came back since the last call, each once."""
        ...

    def report_slow(self, reason: str) -> None:
        """A request's wait on storage timed out: counts against storage health."""
        ...

    def metrics(self) -> dict[str, float]:
        """Counters and gauges, flat, for an exporter."""
        ...

    def quarantined_buffers(self) -> int:
        """Buffers an adapter may still write into, for tasks already reported."""
        ...

    def object_key_string(self, key: StorageKey) -> str:
        """The backend's name for `key` (file name stem, Redis key): tools and tests."""
        ...

    def close(self) -> None:
        """Stop; unfinished tasks finish with `TaskError.CLOSED`. Idempotent."""
        ...
