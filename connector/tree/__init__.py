"""The hybrid radix tree: himamba's tiered prefix index (pure Python, no vLLM import).

``tree.HybridRadixTree`` is the contract (what a caller may do and what it costs); the other
modules are its parts, one concern each: ``node`` (a run of blocks and its tier bits),
``forest`` (the shape), ``eviction`` (who goes next), ``host_eviction`` (freeing host slots),
``reservations`` (stores: reserve, commit, roll back), ``maintenance`` (invariants P and B),
``slot_allocator`` (host slot indices, quarantine, free journal), ``results`` (match results
and lock handles) and ``invariants`` (the checker the tests run).
"""

from .invariants import check_invariants, invariants_hold
from .node import ALL_TIERS, GPU, HOST, LOADABLE, NO_SLOT, PENDING, STORAGE
from .results import LockHandle, MatchResult, StoreCursor
from .slot_allocator import SlotAllocator
from .tree import HybridRadixTree

__all__ = [
    "ALL_TIERS",
    "GPU",
    "HOST",
    "LOADABLE",
    "NO_SLOT",
    "PENDING",
    "STORAGE",
    "HybridRadixTree",
    "LockHandle",
    "MatchResult",
    "SlotAllocator",
    "StoreCursor",
    "check_invariants",
    "invariants_hold",
]
