"""Circuit breaker for the storage tier.

Why: LMCache's native Redis adapter fails fast while Redis is down but never reconnects once it
is back (and still reports itself healthy), and an adapter created while the server is down
hangs its tasks forever. So "storage is broken" must be decided by us, from outcomes, and the
cure is a fresh adapter, not a retry. Storage that is alive but too slow for the requests that
wait on it is broken too, from the scheduler's side: its timed-out waits count as failures.

Re-opening backs off: storage that keeps failing right after each recovery (a flapping link, a
server that answers a tiny probe but not real traffic) would otherwise cost every request a
full wait once per cool-down. Each re-open without a healthy period in between doubles the
cool-down, up to `max_cooldown_s`; a healthy period is `max_cooldown_s` spent closed.
Pure state, injectable clock: testable without I/O. Thread-safe: the store's driver thread
records op outcomes while the scheduler's thread reports a timed-out wait, and that verdict
must count at once (the driver may be stuck in a slow adapter call at that very moment).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum


class BreakerState(str, Enum):
    CLOSED = "closed"  # ops go to the adapter
    OPEN = "open"  # every op is a miss at once; waiting out the cool-down
    PROBING = "probing"  # a fresh adapter is being probed; ops are still misses


class CircuitBreaker:
    """CLOSED -(N consecutive failures | trip)-> OPEN -(cool-down)-> PROBING -> CLOSED | OPEN."""

    def __init__(
        self,
        failures: int,
        cooldown_s: float,
        max_cooldown_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._threshold = max(1, failures)
        self._base = cooldown_s
        self._max = max(cooldown_s, cooldown_s if max_cooldown_s is None else max_cooldown_s)
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._closed_at: float | None = None  # last recovery; None: never opened
        self._cooldown = cooldown_s
        self.opens = 0  # how many times the breaker tripped from CLOSED (a metric)
        self.last_reason = ""
        self._lock = threading.RLock()

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def cooldown_s(self) -> float:
        """The wait before the next probe (grows with each re-open, see module doc)."""
        return self._cooldown

    def allow(self) -> bool:
        """Whether a new op may reach the adapter."""
        return self._state is BreakerState.CLOSED

    def record_success(self) -> None:
        with self._lock:
            if self._state is BreakerState.CLOSED:
                self._consecutive = 0

    def record_failure(self, reason: str = "failure") -> bool:
        """Count a failed op; True if this one opened the breaker."""
        with self._lock:
            if self._state is not BreakerState.CLOSED:
                return False
            self._consecutive += 1
            if self._consecutive >= self._threshold:
                self.trip(reason)
                return True
            return False

    def trip(self, reason: str) -> bool:
        """Open now (a failed health probe needs no second opinion); True if it was closed."""
        with self._lock:
            was_closed = self._state is BreakerState.CLOSED
            if was_closed:
                self.opens += 1
                healthy = (
                    self._closed_at is not None and self._clock() - self._closed_at >= self._max
                )
                if self._closed_at is None or healthy:
                    self._cooldown = self._base
                else:
                    self._back_off()
            elif self._state is BreakerState.PROBING:
                self._back_off()
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            self._consecutive = 0
            self.last_reason = reason
            return was_closed

    def should_probe(self) -> bool:
        """OPEN and cooled down: the caller recreates the adapter and probes it (-> PROBING)."""
        with self._lock:
            if (
                self._state is BreakerState.OPEN
                and self._clock() - self._opened_at >= self._cooldown
            ):
                self._state = BreakerState.PROBING
                return True
            return False

    def probe_result(self, ok: bool, reason: str = "probe failed") -> None:
        with self._lock:
            if self._state is not BreakerState.PROBING:
                return
            if ok:
                self._state = BreakerState.CLOSED
                self._consecutive = 0
                self._closed_at = self._clock()
            else:
                self.trip(reason)

    def _back_off(self) -> None:
        self._cooldown = min(self._max, self._cooldown * 2)
