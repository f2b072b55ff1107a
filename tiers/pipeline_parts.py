"""What the put and get paths of the task pipeline share, handed to each as one record."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from .adapter_health import AdapterHealth
from .in_flight import InFlight
from .lmcache_shapes import LMCacheShapes
from .object_format import ChecksumAlgo, Namespace
from .storage_records import StoreStats
from .task_book import TaskBook


@dataclass(frozen=True)
class PipelineParts:
    """One namespace's object shapes and checksum, the task book, the adapter's calls in
    flight, its health, the counters, the CPU workers, and the way onto the driver thread."""

    namespace: Namespace
    algo: ChecksumAlgo
    shapes: LMCacheShapes
    book: TaskBook
    calls: InFlight
    health: AdapterHealth
    stats: StoreStats
    cpu: Executor
    post: Callable[[Callable[[], None]], None]
