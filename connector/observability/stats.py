"""What each connector role reports to vLLM's stats path each step (payload: ``metrics``).

The halves keep monotonic counters for their own use (tests, leak reports, ``stats()``); these
sources turn them into per-interval deltas, drain the per-operation recorders, and read the
storage tier's counters, so a report covers exactly what happened since the previous one:

* scheduler: hits by tier, CPU-tier stores and evictions, occupancy (only here: the scheduler
  owns the slot allocators, so TP workers never count it), storage fetches, and the errors and
  breaker of the scheduler's own store (it only probes);
* worker: copy and storage-op histograms, storage writes and capacity evictions, and its store's
  errors and breaker (every rank has one; their deltas add up, the breaker merges by max).

Steps where nothing changed report nothing (``None``): an idle or decode-only step costs a few
integer comparisons.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from himamba.connector.observability.metrics import Breaker, HiMambaStats, StatsRecorder

if TYPE_CHECKING:
    from himamba.connector.scheduler.scheduler_half import SchedulerHalf
    from himamba.connector.worker.worker_half import WorkerHalf
    from himamba.tiers.byte_store import ByteStore

_BREAKER = {"closed": Breaker.CLOSED, "open": Breaker.OPEN, "probing": Breaker.PROBING}


class Deltas:
    """Deltas of monotonic counters since the last read. A counter derived from two that
    another thread updates one after the other may dip for an instant: a dip is never
    reported and does not move the baseline, so the next read reports the true delta."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, key: str, value: float) -> float:
        d = value - self._last.get(key, 0)
        if d > 0:
            self._last[key] = value
            return d
        return 0


class StoreReader:
    """Errors, skipped writes and breaker of one ``LMCacheStore`` (``StoreStats`` counters)."""

    def __init__(self, store: ByteStore) -> None:
        self.store = store
        self._d = Deltas()
        self._last: tuple[int, ...] = ()
        # None: nothing reported for this store yet. Its first state is always reported: the
        # gauge may still show the state of the store it replaced.
        self._breaker: Breaker | None = None

    def read_into(self, rec: StatsRecorder) -> None:
        st = getattr(self.store, "stats", None)
        if st is None:
            return
        invalid = st.invalid
        checksum = invalid.get("checksum", 0)
        header = sum(invalid.values()) - checksum
        now = (
            st.deadline_expired,
            checksum,
            header,
            st.get_misses,
            st.put_failed + st.probes_failed,
            st.puts_skipped,
            st.breaker_opens,
        )
        if now != self._last:  # the store's driver thread writes these: see Deltas
            self._last = now
            d = self._d
            rec.add("storage_errors", d("timeout", now[0]), "timeout")
            rec.add("storage_errors", d("checksum", checksum), "checksum")
            rec.add("storage_errors", d("invalid", header), "invalid")
            # Get misses not explained by a failed validation: absent, truncated, unreadable.
            rec.add("storage_errors", d("missing", now[3] - header - checksum), "missing")
            rec.add("storage_errors", d("backend", now[4]), "backend")
            rec.add("storage_writes_skipped", d("skipped", now[5]))
            rec.add("storage_breaker_opens", d("opens", now[6]))
        state = _BREAKER.get(getattr(self.store.breaker_state, "value", ""), Breaker.CLOSED)
        # Reported every step while not closed, and once on closing: merged by max, the gauge
        # then shows the worst store's state even when stores change state in different steps.
        if state is not Breaker.CLOSED or state is not self._breaker:
            rec.set("storage_breaker_state", int(state))
        self._breaker = state


def read_store(
    current: StoreReader | None, store: ByteStore | None, rec: StatsRecorder
) -> StoreReader | None:
    """Read the attached ``store`` (None: none) into ``rec``; returns the reader to keep.

    A store switched at run time gets a fresh reader (its counters start from zero, and its
    breaker state is reported at once); a detach reports the breaker closed once, so the gauge
    never shows the state of a store that is gone."""
    if store is None:
        if current is not None:
            rec.set("storage_breaker_state", int(Breaker.CLOSED))
        return None
    reader = current if current is not None and current.store is store else StoreReader(store)
    reader.read_into(rec)
    return reader


# (metric, series) of each scheduler counter, in the order ``SchedulerStats._read`` reads them.
_SCHEDULER_COUNTERS = (
    ("hit_tokens", "cpu"),
    ("hit_tokens", "storage"),
    ("stores", "cpu,kv"),
    ("stores", "cpu,mamba"),
    ("evictions", "cpu,kv"),
    ("evictions", "cpu,mamba"),
    ("load_failures", ""),
    ("storage_fetches", "ok"),
    ("storage_fetches", "failed"),
)


class SchedulerStats:
    """The scheduler half's per-interval report. Runs every engine step, so an unchanged step
    costs one tuple of integers and one comparison."""

    def __init__(self, half: SchedulerHalf) -> None:
        self.half = half
        self._rec = StatsRecorder()
        self._last: tuple[int, ...] = (0,) * (len(_SCHEDULER_COUNTERS) + 2)
        self._capacity_sent = False
        self._store: StoreReader | None = None

    def _read(self) -> tuple[int, ...]:
        half = self.half
        c, t, tree = half.counters, half.tree.counters, half.tree
        return (
            c.hit_tokens - c.hit_tokens_storage,
            c.hit_tokens_storage,
            c.kv_blocks_stored,
            c.mamba_states_stored,
            t.kv_evicted + t.kv_cascaded,
            t.mamba_evicted + t.mamba_cascaded,
            c.loads_failed,
            c.storage_fetched,
            c.storage_fetch_failed,
            tree.kv_slots.num_used,
            tree.mamba_slots.num_used,
        )

    def take(self) -> HiMambaStats | None:
        rec, half = self._rec, self.half
        now = self._read()
        last = self._last
        if now != last:
            self._last = now
            for (name, series), new, old in zip(_SCHEDULER_COUNTERS, now, last, strict=False):
                if new > old:  # monotonic counters, written by this thread only
                    rec.add(name, new - old, series)
            k = len(_SCHEDULER_COUNTERS)
            if now[k] != last[k] or not self._capacity_sent:
                rec.set("cpu_slots_used", now[k], "kv")
            if now[k + 1] != last[k + 1] or not self._capacity_sent:
                rec.set("cpu_slots_used", now[k + 1], "mamba")
        if not self._capacity_sent:
            self._capacity_sent = True
            rec.set("cpu_slots_capacity", half.tree.kv_slots.capacity, "kv")
            rec.set("cpu_slots_capacity", half.tree.mamba_slots.capacity, "mamba")
        storage = half.storage
        self._store = read_store(self._store, None if storage is None else storage.store, rec)
        return rec.take()


class WorkerStats:
    """One worker half's per-interval report (the histograms are recorded as work happens)."""

    def __init__(self, half: WorkerHalf) -> None:
        self.half = half
        self._store: StoreReader | None = None

    def take(self) -> HiMambaStats | None:
        half = self.half
        out = half.recorder.take()
        storage = half.storage
        rec = half.recorder if storage is None else storage.recorder
        self._store = read_store(self._store, None if storage is None else storage.store, rec)
        more = rec.take()
        if more is not None:
            out = more if out is None else out.aggregate(more)
        return out
