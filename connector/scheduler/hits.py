"""Hits promised to vLLM: from the lookup that promises one until the worker reports its load.

Two of the scheduler half's rules (see ``scheduler_half``) are kept here and only here:

- every hit is locked in the tree from lookup until the worker reports the load: ``promise``
  locks, ``take_pending`` / ``loading`` hand the lock to the load, ``load_done`` unlocks, and
  ``release`` unlocks a promise vLLM did not take up;
- a request whose load failed is never offered a hit again (``bar`` / ``barred``).

The scheduler half decides what to promise and plans the loads; this book only holds the locks
and the per-request records, so that nothing is left behind once a request is forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass

from himamba.connector.tree import HybridRadixTree, LockHandle, MatchResult


@dataclass
class PendingHit:
    """A hit promised to vLLM and locked, waiting for its blocks."""

    result: MatchResult
    handle: LockHandle
    num_blocks: int
    mamba_slot: int
    # Tokens promised past the request's local hit (less than whole blocks at a tail).
    tokens: int = 0


class HitBook:
    def __init__(self, tree: HybridRadixTree) -> None:
        self.tree = tree
        self._pending: dict[str, PendingHit] = {}
        self._inflight: dict[str, LockHandle] = {}
        self._barred: set[str] = set()
        # Requests whose hit was counted as a use of its path (selective write-through's
        # threshold): a retried lookup locks again but is not another use.
        self._counted: set[str] = set()
        # (host tokens, storage tokens) of each request's external hit, for vLLM's metrics.
        self._split: dict[str, tuple[int, int]] = {}

    # -- promise -> load -> done ---------------------------------------------------------
    def first_use(self, req_id: str) -> bool:
        """No hit of this request was counted as a use of its path yet."""
        return req_id not in self._counted

    def promise(self, req_id: str, result: MatchResult, num_blocks: int, tokens: int) -> bool:
        """Lock the host part of ``result`` (``num_blocks`` deep, ``tokens`` promised) for
        ``req_id``; False if the tree could not lock it."""
        handle = self.tree.lock(result, host_only=True, count_hit=self.first_use(req_id))
        if handle is None:
            return False
        self._counted.add(req_id)
        self._pending[req_id] = PendingHit(
            result, handle, num_blocks, result.state_slot(True), tokens
        )
        return True

    def take_pending(self, req_id: str) -> PendingHit | None:
        """The request's promised hit, still locked: the caller hands its lock to ``loading``
        or back to the tree."""
        return self._pending.pop(req_id, None)

    def loading(
        self, req_id: str, handle: LockHandle, host_tokens: int, storage_tokens: int
    ) -> None:
        """The hit's load joined a plan: its lock is held until the worker reports it."""
        self._inflight[req_id] = handle
        self._split[req_id] = (host_tokens, storage_tokens)

    def load_done(self, req_id: str) -> bool:
        """The worker reported the load (done or failed): unlock. False if none was in flight."""
        handle = self._inflight.pop(req_id, None)
        if handle is None:
            return False
        self.tree.unlock(handle)
        return True

    def release(self, req_id: str) -> None:
        """Unlock a promise that will not be loaded (a new lookup, vLLM took no tokens, the
        request finished, a reset)."""
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            self.tree.unlock(pending.handle)

    def release_all(self) -> None:
        for req_id in list(self._pending):
            self.release(req_id)

    # -- per request -------------------------------------------------------------------
    def bar(self, req_id: str) -> None:
        """Never offer this request a hit again (its load failed: no retry loop)."""
        self._barred.add(req_id)

    def barred(self, req_id: str) -> bool:
        return req_id in self._barred

    def unsettled(self, req_id: str) -> bool:
        """A hit of the request is promised or its load not yet reported: its blocks may not
        hold the hit's bytes yet."""
        return req_id in self._pending or req_id in self._inflight

    def forget(self, req_id: str) -> None:
        """The request finished: nothing of it is kept."""
        self.release(req_id)
        self._barred.discard(req_id)
        self._counted.discard(req_id)
        self._split.pop(req_id, None)

    def hit_sources(self, req_id: str, num_external_tokens: int) -> tuple[int, int]:
        """(host tokens, storage tokens) of a request's external hit: storage counts only the
        blocks of the hit that its fetch brought in, not everything it fetched."""
        _, storage = self._split.get(req_id, (num_external_tokens, 0))
        storage = min(storage, num_external_tokens)
        return num_external_tokens - storage, storage

    # -- introspection -------------------------------------------------------------------
    def loads_in_flight(self) -> bool:
        """Loads sent to the workers and not reported yet (they cannot be called back)."""
        return bool(self._inflight)

    def leak_report(self) -> dict[str, int]:
        return {
            "pending_hits": len(self._pending),
            "inflight_loads": len(self._inflight),
            "no_hit_requests": len(self._barred),
            "hit_records": len(self._counted) + len(self._split),
        }
