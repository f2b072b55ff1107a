"""Faults that real parts cannot produce on demand, injected at the narrowest seam.

- storage ops held back or failed: a proxy around the LMCache L2 adapter (the store's own
  deadlines, breaker and validation stay real);
- a failed host->device copy: ``CopyPlan.run_host`` raising on the copy thread;
- lost or late worker acknowledgements: one rank's ``kv_connector_worker_meta`` dropped or
  delayed at the ModelRunnerOutput boundary, where vLLM would deliver it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import random
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.outputs import KVConnectorOutput


@contextlib.contextmanager
def replaced_everywhere(module_name: str, attr: str, replacement: Any) -> Iterator[Any]:
    """Replace ``module.attr`` and every himamba module's by-name import of it.

    Modules written as ``from x import f`` keep their own reference; patching only ``x.f``
    would silently miss them. Default arguments bound at definition time
    (``factory=create_adapter``) are swapped too. On exit every reference to the replacement,
    including ones taken by modules first imported inside the block, is put back. Yields the
    original.
    """
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    _swap_references(original, replacement)
    try:
        yield original
    finally:
        _swap_references(replacement, original)


def _swap_references(old: Any, new: Any) -> None:
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("himamba"):
            continue
        for key, value in list(vars(mod).items()):
            if value is old:
                setattr(mod, key, new)
            for fn in _functions_of(value):
                defaults = fn.__defaults__
                if defaults and any(d is old for d in defaults):
                    fn.__defaults__ = tuple(new if d is old else d for d in defaults)


def _functions_of(value: Any) -> list[Any]:
    if isinstance(value, type):
        return [f for f in vars(value).values() if hasattr(f, "__defaults__")]
    return []


def _ranks_module() -> str:
    """Where ``worker_rank`` lives (it moved into ``connector.worker``; older trees kept it
    flat, and the suite also runs against those: a module an editable install's import hook
    finds in another tree is not the one the connector under test calls)."""
    import himamba.connector

    home = os.path.realpath(os.path.dirname(himamba.connector.__file__))
    for name in ("himamba.connector.worker.ranks", "himamba.connector.ranks"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if os.path.realpath(module.__file__ or "").startswith(home + os.sep):
            return name
    raise ImportError("no himamba ranks module")


@contextlib.contextmanager
def worker_rank_as(rank: int) -> Iterator[None]:
    """Make the worker connector built inside this block believe it is TP rank ``rank``."""
    with replaced_everywhere(_ranks_module(), "worker_rank", lambda: rank):
        yield


# -- storage adapter proxy ------------------------------------------------------------------


@dataclass
class StorageFaults:
    """What the adapter proxy does; tests flip these while the engine runs.

    hold_*: completions of that kind are withheld (the op looks slow) until released.
    fail_rate_*: a completed op is turned into an all-miss / failed result with this chance.
    """

    hold_lookups: threading.Event = field(default_factory=threading.Event)
    hold_loads: threading.Event = field(default_factory=threading.Event)
    hold_stores: threading.Event = field(default_factory=threading.Event)
    fail_rate_lookup: float = 0.0
    fail_rate_load: float = 0.0
    fail_rate_store: float = 0.0
    seed: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def roll(self, rate: float, what: str) -> bool:
        if rate <= 0:
            return False
        with self._lock:
            hit = self._rng.random() < rate
            if hit:
                self.counts["failed_" + what] = self.counts.get("failed_" + what, 0) + 1
            return hit

    def release(self) -> None:
        self.hold_lookups.clear()
        self.hold_loads.clear()
        self.hold_stores.clear()


class _EmptyBitmap:
    def get_indices_list(self) -> list[int]:
        return []


class _FailedStore:
    def is_successful(self) -> bool:
        return False


class FaultyAdapter:
    """Forwards to a real LMCache L2 adapter; withholds or fails completions on demand."""

    def __init__(self, inner: Any, faults: StorageFaults) -> None:
        self._inner = inner
        self._faults = faults
        self._held_stores: dict[int, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def submit_lookup_and_lock_task(self, *args: Any, **kwargs: Any) -> Any:
        self._faults.count("submitted_lookups")
        return self._inner.submit_lookup_and_lock_task(*args, **kwargs)

    def submit_load_task(self, *args: Any, **kwargs: Any) -> Any:
        self._faults.count("submitted_loads")
        return self._inner.submit_load_task(*args, **kwargs)

    def submit_store_task(self, *args: Any, **kwargs: Any) -> Any:
        self._faults.count("submitted_stores")
        return self._inner.submit_store_task(*args, **kwargs)

    def query_lookup_and_lock_result(self, tid: int) -> Any:
        if self._faults.hold_lookups.is_set():
            return None
        res = self._inner.query_lookup_and_lock_result(tid)
        if res is not None and self._faults.roll(self._faults.fail_rate_lookup, "lookup"):
            return _EmptyBitmap()
        return res

    def query_load_result(self, tid: int) -> Any:
        if self._faults.hold_loads.is_set():
            return None
        res = self._inner.query_load_result(tid)
        if res is not None and self._faults.roll(self._faults.fail_rate_load, "load"):
            return _EmptyBitmap()
        return res

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        self._held_stores.update(self._inner.pop_completed_store_tasks())
        if self._faults.hold_stores.is_set():
            return {}
        out, self._held_stores = self._held_stores, {}
        for tid in list(out):
            if self._faults.roll(self._faults.fail_rate_store, "store"):
                out[tid] = _FailedStore()
        return out


@contextlib.contextmanager
def faulty_storage(faults: StorageFaults) -> Iterator[StorageFaults]:
    """Every LMCache store opened inside this block talks to its adapter through the proxy."""
    from himamba.tiers import lmcache_store

    real = lmcache_store.create_lmcache_adapter

    def factory(spec: dict[str, Any]) -> Any:
        return FaultyAdapter(real(spec), faults)

    with replaced_everywhere("himamba.tiers.lmcache_store", "create_lmcache_adapter", factory):
        yield faults


# -- failed host -> device loads ------------------------------------------------------------


@dataclass
class LoadFaults:
    """Make host -> device copies raise: for the next ``fail_next`` loads, or with a rate."""

    fail_next: int = 0
    fail_rate: float = 0.0
    seed: int = 0
    failed: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def should_fail(self) -> bool:
        if self.fail_next > 0:
            self.fail_next -= 1
            return True
        return self.fail_rate > 0 and self._rng.random() < self.fail_rate


@contextlib.contextmanager
def failing_loads(faults: LoadFaults) -> Iterator[LoadFaults]:
    """Fail host -> device copies on the copy engine's thread, where a real one would fail."""
    from himamba.tiers.transfer import CopyPlan

    real: Callable[..., Any] = CopyPlan.run_host

    def run_host(plan: CopyPlan) -> None:
        if not plan.to_host and plan.nbytes and faults.should_fail():
            faults.failed += 1
            raise RuntimeError("injected host->device copy failure")
        real(plan)

    CopyPlan.run_host = run_host  # type: ignore[method-assign]
    try:
        yield faults
    finally:
        CopyPlan.run_host = real  # type: ignore[method-assign]


# -- worker metadata at the ModelRunnerOutput boundary -------------------------------------


@dataclass
class AckFault:
    """Delay (``delay_steps`` > 0) or drop (``drop``) a rank's worker metadata.

    ``remaining`` bounds how many non-empty metas are affected (None = all); ``rate``
    picks them at random. A delayed meta is merged into the meta that rank sends
    ``delay_steps`` steps later, as a slow rank's late report would arrive. ``keep_control``:
    a dropped meta loses only its fetch acknowledgements; the storage switches it reports
    (run-time control) still arrive, as vLLM delivers every ModelRunnerOutput.
    """

    rank: int
    delay_steps: int = 0
    drop: bool = False
    remaining: int | None = None
    rate: float = 1.0
    seed: int = 0
    keep_control: bool = False
    dropped: int = 0
    delayed: int = 0
    _held: list[tuple[int, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def __call__(self, rank: int, step: int, out: KVConnectorOutput) -> KVConnectorOutput:
        if rank != self.rank:
            return out
        meta = out.kv_connector_worker_meta
        due = [m for s, m in self._held if s <= step]
        self._held = [(s, m) for s, m in self._held if s > step]
        no_acks = self.keep_control and not getattr(meta, "fetch_acks", None)
        if meta is not None and not no_acks and self._affects():
            kept = None
            if self.drop:
                self.dropped += 1
                if self.keep_control and getattr(meta, "control", None):
                    kept = dataclasses.replace(meta, fetch_acks=[])
            else:
                self.delayed += 1
                self._held.append((step + self.delay_steps, meta))
            meta = kept
        for late in due:
            meta = late if meta is None else meta.aggregate(late)
        out.kv_connector_worker_meta = meta
        return out

    def _affects(self) -> bool:
        if self.remaining is not None:
            if self.remaining <= 0:
                return False
        if self.rate < 1.0 and self._rng.random() >= self.rate:
            return False
        if self.remaining is not None:
            self.remaining -= 1
        return True

    def arm(self, n: int) -> None:
        """Affect ``n`` more non-empty metadata (for faults created with ``remaining``)."""
        self.remaining = (self.remaining or 0) + n

    @property
    def holding(self) -> bool:
        return bool(self._held)
