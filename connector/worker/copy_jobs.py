"""The worker's copies in flight: stores that still read device blocks, loads not yet reported.

Why stores may run past ``wait_for_save``: the forward of the next step is what could
overwrite a source block (a freed block handed to another request, a preempted request's
blocks, a Mamba block vLLM stops retaining). The worker fences at the first worker hook of
every step (``handle_preemptions``, which Model Runner V1 calls before it zeroes or copies any
block): on CPU it calls ``wait_stores``, so no block is ever rewritten while a store reads it,
whatever freed it. Model Runner V2 zeroes and copies before that hook, so there the fence runs
from himamba's step-start hook (``vllm_fixups.runner_v2_hook``), or, without it, a CPU worker
waits at the end of ``wait_for_save`` (``RunnerOrder.BLOCKS_FIRST``). On a GPU
the engine already orders this on the device (the compute stream waits for the copy event),
so the fence there only reaps what completed and never blocks the CPU.

Host slots become readable (storage writes, and through the scheduler, loads) only after their
store completed: completed stores are handed back by ``reap_stores`` and only then given to
storage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from himamba.connector.observability.metrics import StatsRecorder
from himamba.connector.protocol import ObjectKind, StoreDone
from himamba.connector.worker.counters import CopyCounters
from himamba.tiers.transfer import CopyPlan
from himamba.tiers.transfer_engine import CopyEngine


@dataclass(frozen=True)
class _CallPlan:
    """A callable dressed as a host copy plan, so the FIFO copy thread runs it in order."""

    fn: Callable[[], None]
    to_host: bool = True
    copies: tuple = ()
    nbytes: int = 0
    rows: int = 0

    def run_host(self) -> None:
        self.fn()


class CopyFailed(RuntimeError):
    """A store copy failed: its host slots hold unknown bytes, so serving on is unsafe."""


@dataclass
class _Store:
    done: StoreDone
    nbytes: int


@dataclass
class _Load:
    req_id: str
    nbytes: int


class CopyJobs:
    def __init__(self, engine: CopyEngine, counters: CopyCounters, recorder: StatsRecorder) -> None:
        self.engine = engine
        self._counters = counters
        self._recorder = recorder
        self._stores: dict[int, _Store] = {}
        self._loads: dict[int, _Load] = {}
        # (kind, slot) -> store job filling it, until that store is reaped.
        self._filling: dict[tuple[ObjectKind, int], int] = {}
        # Storage staging copies queued behind the stores (CPU engine only).
        self._calls: set[int] = set()

    # -- stores ---------------------------------------------------------------------------
    def submit_store(self, plans: Sequence[CopyPlan], done: StoreDone) -> None:
        nbytes = sum(p.nbytes for p in plans)
        if not nbytes:
            return
        self._count(plans)
        job = self.engine.submit(plans)
        self._stores[job] = _Store(done, nbytes)
        for batch in done.batches:
            for slot in batch.slots:
                self._filling[(batch.kind, slot)] = job

    def stores_into(self, kind: ObjectKind, slots: Sequence[int]) -> bool:
        """Whether a store not yet reaped fills any of ``slots``."""
        filling = self._filling
        return bool(filling) and any((kind, s) in filling for s in slots)

    def wait_stores(self) -> list[StoreDone]:
        """Wait for every store in flight; returns them (completed) for storage."""
        if not self._stores:
            return []
        self.engine.wait(list(self._stores))
        return self.reap_stores()

    def reap_stores(self) -> list[StoreDone]:
        """Stores that completed since the last call (non-blocking)."""
        out = []
        for r in self.engine.collect(list(self._stores)):
            store = self._stores.pop(r.job_id)
            for batch in store.done.batches:
                for slot in batch.slots:
                    if self._filling.get((batch.kind, slot)) == r.job_id:
                        del self._filling[(batch.kind, slot)]
            if not r.ok:
                raise CopyFailed(f"himamba: a store into the host tier failed: {r.error}")
            self._counters.bytes_stored += store.nbytes
            self._counters.store_seconds += r.seconds
            self._recorder.observe("store_seconds", r.seconds)
            self._recorder.observe("store_bytes", store.nbytes)
            out.append(store.done)
        return out

    # -- other work on the copy thread ------------------------------------------------------
    def submit_call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the copy thread after every copy submitted so far (FIFO): a storage
        write's copy out of host slots, which a later store into those slots must not pass."""
        self._calls.add(self.engine.submit([_CallPlan(fn)]))

    def wait_calls(self) -> None:
        """Wait until every queued call ran (before a slot is lent to the storage adapter)."""
        if self._calls:
            self.engine.wait(list(self._calls))
            self.reap_calls()

    def reap_calls(self) -> None:
        for r in self.engine.collect(list(self._calls)):
            self._calls.discard(r.job_id)
            if not r.ok:
                raise CopyFailed(f"himamba: a storage staging copy failed: {r.error}")

    # -- loads ----------------------------------------------------------------------------
    def submit_load(self, req_id: str, plans: Sequence[CopyPlan]) -> None:
        self._count(plans)
        job = self.engine.submit(plans)
        self._loads[job] = _Load(req_id, sum(p.nbytes for p in plans))

    def reap_loads(self, wait: bool) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids of loads that completed; with ``wait``, all of them."""
        if wait and self._loads:
            self.engine.wait(list(self._loads))
        finished: set[str] = set()
        failed: set[str] = set()
        for r in self.engine.collect(list(self._loads)):
            load = self._loads.pop(r.job_id)
            finished.add(load.req_id)
            if not r.ok:
                failed.add(load.req_id)
                self._counters.loads_failed += 1
                continue
            self._counters.bytes_loaded += load.nbytes
            self._counters.load_seconds += r.seconds
            self._recorder.observe("load_seconds", r.seconds)
            self._recorder.observe("load_bytes", load.nbytes)
        return finished, failed

    def _count(self, plans: Sequence[CopyPlan]) -> None:
        # How much runs coalesce in practice: copy_rows / copy_calls is the mean run length.
        self._counters.copy_rows += sum(p.rows for p in plans)
        self._counters.copy_calls += sum(len(p.copies) for p in plans)

    def store_jobs(self) -> set[int]:
        """Ids of the store jobs not yet fenced or reaped."""
        return set(self._stores)

    def in_flight(self) -> dict[str, int]:
        return {
            "stores_in_flight": len(self._stores),
            "loads_in_flight": len(self._loads),
            "staging_in_flight": len(self._calls),
        }

    def close(self) -> None:
        self.engine.close()
