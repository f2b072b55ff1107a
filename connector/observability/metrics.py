"""Prometheus metrics of the tiers, carried through vLLM's connector-stats path.

Which process does what (vLLM 0.32 / 0.33):

* the scheduler connector (engine core) and every worker connector return a ``HiMambaStats``
  from ``get_kv_connector_stats`` each step; vLLM merges the workers' with ``aggregate``
  (``KVOutputAggregator``), then the scheduler's into that, and ships ``data`` to the API
  process inside ``SchedulerStats`` (msgpack: so ``data`` holds only str keys, numbers, lists);
* the API process rebuilds it with ``build_kv_connector_stats`` (the log line) and hands
  ``data`` to ``HiMambaPromMetrics.observe`` (built once by ``build_prom_metrics``).

Payload (``HiMambaStats.data``): ``{"counter": {name: {series: delta}}, "gauge": {name:
{series: value}}, "histogram": {name: {series: [observations]}}}``; ``name`` is a key of
``METRICS`` and ``series`` the metric's extra label values joined by ``,`` ("" when it has none).
Counters are deltas since the reporter's last report, so summing workers is right; gauges are
set by one reporter each (occupancy: the scheduler only, so TP workers never count it twice)
and merge by ``max`` (the breaker: the worst state any store is in).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

PREFIX = "vllm:himamba_"


class Kind(str, enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


# Latency of one copy or storage op: sub-millisecond host copies up to multi-second backend stalls.
SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
)  # fmt: skip
# Bytes of one copy or storage op: one Mamba state (KiB) up to a long prompt's KV (GiB).
BYTES_BUCKETS = tuple(float(4**k) for k in range(5, 17))  # 1 KiB .. 1 GiB

TIERS = ("cpu", "storage")
OBJECTS = ("kv", "mamba")
STORAGE_ERRORS = ("timeout", "checksum", "invalid", "missing", "backend")
STORAGE_OPS = ("fetch", "write")


class Breaker(enum.IntEnum):
    """Gauge values of ``storage_breaker_state`` (``tiers.circuit_breaker.BreakerState``)."""

    CLOSED = 0
    OPEN = 1
    PROBING = 2


@dataclass(frozen=True)
class MetricDef:
    """One exported metric: its name after ``PREFIX``, extra labels, and every series it has
    from the start (exported at 0, so a dashboard never sees a series appear late)."""

    name: str
    kind: Kind
    doc: str
    labels: tuple[str, ...] = ()
    series: tuple[tuple[str, ...], ...] = ((),)
    buckets: tuple[float, ...] = ()


def _pairs(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return tuple((x, y) for x in a for y in b)


METRICS: dict[str, MetricDef] = {
    m.name: m
    for m in (
        MetricDef("hit_tokens", Kind.COUNTER,
                  "Prompt tokens served by himamba, by the tier they came from (storage: "
                  "fetched to the CPU tier for this request first).",
                  ("tier",), tuple((t,) for t in TIERS)),
        MetricDef("stores", Kind.COUNTER,
                  "Objects stored into a tier: KV blocks or Mamba states (storage: objects "
                  "written, one per TP rank).",
                  ("tier", "object"), _pairs(TIERS, OBJECTS)),
        MetricDef("evictions", Kind.COUNTER,
                  "Objects a tier dropped for space (cpu: LRU eviction and the prefix cascade "
                  "behind it; storage: capacity_gb eviction, one per TP rank).",
                  ("tier", "object"), _pairs(TIERS, OBJECTS)),
        MetricDef("cpu_slots_used", Kind.GAUGE,
                  "Host-tier slots in use (KV: one block per slot; Mamba: one state per slot).",
                  ("object",), tuple((o,) for o in OBJECTS)),
        MetricDef("cpu_slots_capacity", Kind.GAUGE,
                  "Host-tier slots configured (cpu_cache_gb split by mamba_cache_fraction).",
                  ("object",), tuple((o,) for o in OBJECTS)),
        MetricDef("load_failures", Kind.COUNTER,
                  "Promised CPU-tier loads a worker could not complete (recomputed by vLLM)."),
        MetricDef("storage_fetches", Kind.COUNTER,
                  "Objects fetched storage -> CPU tier, by outcome (failed: missing or invalid "
                  "on some rank).",
                  ("outcome",), (("ok",), ("failed",))),
        MetricDef("storage_errors", Kind.COUNTER,
                  "Storage failures by kind: timeout (op deadline), checksum, invalid (header or "
                  "size), missing (not loadable though listed or promised), backend (failed "
                  "writes and health probes).",
                  ("kind",), tuple((k,) for k in STORAGE_ERRORS)),
        MetricDef("storage_writes_skipped", Kind.COUNTER,
                  "Objects not written to storage because the write buffer was full."),
        MetricDef("storage_breaker_opens", Kind.COUNTER,
                  "Times a storage circuit breaker opened."),
        MetricDef("storage_breaker_state", Kind.GAUGE,
                  "Worst storage circuit-breaker state across the engine's stores: 0 closed, "
                  "1 open, 2 probing."),
        MetricDef("load_seconds", Kind.HISTOGRAM,
                  "CPU tier -> GPU copy time of one request's hit (per TP rank).",
                  buckets=SECONDS_BUCKETS),
        MetricDef("load_bytes", Kind.HISTOGRAM,
                  "Bytes copied CPU tier -> GPU for one request's hit (per TP rank).",
                  buckets=BYTES_BUCKETS),
        MetricDef("store_seconds", Kind.HISTOGRAM,
                  "GPU -> CPU tier copy time of one step's stores (per TP rank).",
                  buckets=SECONDS_BUCKETS),
        MetricDef("store_bytes", Kind.HISTOGRAM,
                  "Bytes copied GPU -> CPU tier in one step (per TP rank).",
                  buckets=BYTES_BUCKETS),
        MetricDef("storage_op_seconds", Kind.HISTOGRAM,
                  "Storage op time from submission to completion (fetch: storage -> CPU tier; "
                  "write: CPU tier -> storage); where the store does not stamp completions, to "
                  "the worker step that collected it.",
                  ("op",), tuple((o,) for o in STORAGE_OPS), SECONDS_BUCKETS),
        MetricDef("storage_op_bytes", Kind.HISTOGRAM,
                  "Bytes moved by one successful storage op (validated payloads).",
                  ("op",), tuple((o,) for o in STORAGE_OPS), BYTES_BUCKETS),
    )
}  # fmt: skip


# Payload section names (plain str: enum attribute access costs on the per-step path).
_COUNTER, _GAUGE, _HISTOGRAM = Kind.COUNTER.value, Kind.GAUGE.value, Kind.HISTOGRAM.value


def series_key(values: tuple[str, ...]) -> str:
    return ",".join(values)


class StatsRecorder:
    """What one process observed since its last report; ``take`` drains it into a payload.

    Cheap enough for per-operation calls (a dict update); nothing is kept once taken."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[str, dict[str, dict[str, Any]]] = {}

    def add(self, name: str, value: float, series: str = "") -> None:
        """Counter increment (ignored when 0, so idle steps report nothing)."""
        if value:
            m = self._data.setdefault(_COUNTER, {}).setdefault(name, {})
            m[series] = m.get(series, 0) + value

    def set(self, name: str, value: float, series: str = "") -> None:
        self._data.setdefault(_GAUGE, {}).setdefault(name, {})[series] = value

    def observe(self, name: str, value: float, series: str = "") -> None:
        h = self._data.setdefault(_HISTOGRAM, {}).setdefault(name, {})
        h.setdefault(series, []).append(value)

    def take(self) -> HiMambaStats | None:
        if not self._data:
            return None
        data, self._data = self._data, {}
        return HiMambaStats(data=data)


@dataclass
class HiMambaStats(KVConnectorStats):
    """One interval's payload (see the module doc for its shape and merge rules)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> HiMambaStats:
        for kind, metrics in other.data.items():
            mine = self.data.setdefault(kind, {})
            for name, series in metrics.items():
                into = mine.setdefault(name, {})
                for key, value in series.items():
                    if kind == _HISTOGRAM:
                        into.setdefault(key, []).extend(value)
                    elif kind == _GAUGE:
                        into[key] = max(into.get(key, value), value)
                    else:
                        into[key] = into.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """Flat summary for vLLM's periodic log line: ``name[series]`` -> number."""
        out: dict[str, int | float] = {}
        for kind, metrics in self.data.items():
            for name, series in metrics.items():
                for key, value in series.items():
                    label = f"{name}[{key}]" if key else name
                    if kind == _HISTOGRAM:
                        out[f"{label}_count"] = len(value)
                        out[f"{label}_sum"] = sum(value)
                    else:
                        out[label] = value
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def get(self, name: str, series: str = "", default: Any = None) -> Any:
        """The value (or observation list) of one series, wherever its kind put it."""
        kind = METRICS[name].kind.value
        return self.data.get(kind, {}).get(name, {}).get(series, default)


class HiMambaPromMetrics(KVConnectorPromMetrics):
    """Registers every ``METRICS`` entry as ``vllm:himamba_<name>`` with vLLM's labels
    (``model_name``, ``engine``) plus its own, every series created up front."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # (engine, name, series) -> labelled child
        self._children: dict[tuple[int, str, str], Any] = {}
        for m in METRICS.values():
            kw: dict[str, Any] = {
                "name": PREFIX + m.name,
                "documentation": m.doc,
                "labelnames": [*labelnames, *m.labels],
            }
            if m.kind is Kind.COUNTER:
                parent = self._counter_cls(**kw)
            elif m.kind is Kind.GAUGE:
                parent = self._gauge_cls(**kw, multiprocess_mode="mostrecent")
            else:
                parent = self._histogram_cls(**kw, buckets=list(m.buckets))
            for engine, values in per_engine_labelvalues.items():
                for s in m.series:
                    child = parent.labels(*values, *s)
                    self._children[(engine, m.name, series_key(s))] = child

    def _child(self, engine: int, name: str, series: str) -> Any:
        child = self._children.get((engine, name, series))
        if child is None:  # never declared: skip it rather than break vLLM's stats logger
            logger.warning("himamba: no metric series %s[%s]; dropped", name, series)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for name, series in data.get(_COUNTER, {}).items():
            for key, value in series.items():
                child = self._child(engine_idx, name, key)
                if child is not None and value > 0:
                    child.inc(value)
        for name, series in data.get(_GAUGE, {}).items():
            for key, value in series.items():
                child = self._child(engine_idx, name, key)
                if child is not None:
                    child.set(value)
        for name, series in data.get(_HISTOGRAM, {}).items():
            for key, values in series.items():
                child = self._child(engine_idx, name, key)
                for v in values if child is not None else ():
                    child.observe(v)
