"""Circuit breaker for the storage tier.

Why: LMCache's native Redis adapter fails fast while Redis is down but never reconnects once it
is back (and still reports itself healthy), and an adapter created while the server is down
hangs its tasks forever. So "storage is broken" must be decided by us, from outcomes, and the
cure is a fresh adapter, not a retry. Pure state, injectable clock: testable without I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum


class BreakerState(str, Enum):
    CLOSED = "closed"  # ops go to the adapter
    OPEN = "open"  # every op is a miss at once; waiting out the cool-down
    PROBING = "probing"  # a fresh adapter is being probed; ops are still misses


class CircuitBreaker:
    """CLOSED -(N consecutive failures | failed probe)-> OPEN -(cool-down)-> PROBING -> CLOSED|OPEN."""

    def __init__(
        self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._threshold = max(1, failures)
        self._cooldown = cooldown_s
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self.opens = 0  # how many times the breaker tripped (a metric)
        self.last_reason = ""

    @property
    def state(self) -> BreakerState:
        return self._state

    def allow(self) -> bool:
        """Whether a new op may reach the adapter."""
        return self._state is BreakerState.CLOSED

    def record_success(self) -> None:
        if self._state is BreakerState.CLOSED:
            self._consecutive = 0

    def record_failure(self, reason: str = "failure") -> bool:
        """Count a failed op; True if this one opened the breaker."""
        if self._state is not BreakerState.CLOSED:
            return False
        self._consecutive += 1
        if self._consecutive >= self._threshold:
            self.trip(reason)
            return True
        return False

    def trip(self, reason: str) -> None:
        """Open now (a failed health probe needs no second opinion)."""
        if self._state is not BreakerState.OPEN:
            self.opens += int(self._state is BreakerState.CLOSED)
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._consecutive = 0
        self.last_reason = reason

    def should_probe(self) -> bool:
        """OPEN and cooled down: the caller recreates the adapter and probes it (-> PROBING)."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self._cooldown:
            self._state = BreakerState.PROBING
            return True
        return False

    def probe_result(self, ok: bool, reason: str = "probe failed") -> None:
        if self._state is not BreakerState.PROBING:
            return
        if ok:
            self._state = BreakerState.CLOSED
            self._consecutive = 0
        else:
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            self.last_reason = reason
