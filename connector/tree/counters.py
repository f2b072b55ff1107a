"""The tree's counters (see ``himamba.connector.counters``)."""

from __future__ import annotations

from dataclasses import dataclass

from himamba.connector.counters import Counters


@dataclass
class TreeCounters(Counters):
    """What the tree did since it was built (``stats()`` reports them)."""

    hits: int = 0
    misses: int = 0
    kv_evicted: int = 0
    mamba_evicted: int = 0
    kv_cascaded: int = 0
    mamba_cascaded: int = 0
    alloc_failures: int = 0
    stores_committed: int = 0
    stores_rolled_back: int = 0
    stale_completions: int = 0
    nodes_trimmed: int = 0
    kv_written_back: int = 0
    mamba_written_back: int = 0
    states_replaced: int = 0
