"""The worker half's counters (see ``himamba.connector.counters``)."""

from __future__ import annotations

from dataclasses import dataclass

from himamba.connector.counters import Counters


@dataclass
class CopyCounters(Counters):
    """Bytes between vLLM's cache and the host tier, and how well copies coalesce."""

    bytes_loaded: float = 0
    bytes_stored: float = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    loads_failed: float = 0
    copy_rows: float = 0  # rows moved; copy_rows / copy_calls is the mean run length
    copy_calls: float = 0


@dataclass
class StorageTrafficCounters(Counters):
    """Bytes between the host tier and storage, as this worker saw them."""

    storage_puts_ok: float = 0
    storage_puts_failed: float = 0
    storage_puts_skipped: float = 0
    storage_gets_ok: float = 0
    storage_gets_in_place: float = 0
    storage_gets_failed: float = 0
    storage_gets_cancelled: float = 0
    storage_bytes_written: float = 0
    storage_bytes_read: float = 0
    storage_evictions: float = 0
