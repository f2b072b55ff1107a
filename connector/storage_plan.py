"""Scheduler-side storage logic: probe storage for a request, then prefetch storage -> CPU.

A request's first lookup submits one ``exists`` for every KV block key and every
Mamba boundary key of its prompt. The answer is folded into the tree as storage
presence (a contiguous KV prefix, states only where that prefix reaches). If the
tree then offers a deeper hit than the host alone, host slots are reserved and
the worker fetches the bytes; the hit becomes an ordinary host hit once every
fetched KV block *and* the state at its boundary have arrived and validated.
While that is pending the lookup answers None ("ask again"), bounded by the
prefetch policy's deadline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from himamba.connector.jobs import FetchItem
from himamba.tiers.object_format import ObjectKind, StorageKey
from himamba.tiers.storage_config import StorageConfig, prefetch_deadline_s

KV, MAMBA = int(ObjectKind.KV), int(ObjectKind.MAMBA)
YIELD_S = 0.0005


@dataclass
class _Probe:
    task_id: int
    deadline: float
    hashes: list[bytes]
    partition: Hashable


@dataclass
class _Fetch:
    deadline: float
    outstanding: set[tuple[int, int]] = field(default_factory=set)
    failed: bool = False
    num_blocks: int = 0


class StoragePlanner:
    def __init__(self, cfg: StorageConfig, store: Any, tree: Any, counters: dict) -> None:
        self.cfg = cfg
        self.store = store
        self.tree = tree
        self.counters = counters
        self._probes: dict[str, _Probe] = {}
        self._probed: set[str] = set()
        self._fetches: dict[str, _Fetch] = {}
        self._owner: dict[tuple[int, int], tuple[str, Sequence[bytes], Hashable, int]] = {}
        self._results: dict[int, Any] = {}
        self.fetch_queue: list[FetchItem] = []
        # Tokens of each request's hit that came through storage (for hit-source metrics).
        self.storage_blocks: dict[str, int] = {}

    # -- probing -------------------------------------------------------------------
    def probe(self, req_id: str, hashes: list[bytes], partition: Hashable, num_tokens: int) -> bool:
        """True while the request should wait for storage (answer None)."""
        self._drain()
        if req_id in self._probed:
            return self._fetch_pending(req_id)
        probe = self._probes.get(req_id)
        if probe is None:
            keys = [StorageKey(h, ObjectKind.KV) for h in hashes]
            keys += [StorageKey(h, ObjectKind.MAMBA) for h in hashes]
            wait, deadline = self._deadline(num_tokens)
            tid = self.store.submit_exists(keys)
            self._probes[req_id] = _Probe(tid, deadline, hashes, partition)
            self.counters["storage_probes"] += 1
            return wait > 0
        result = self._results.pop(probe.task_id, None)
        if result is None:
            if time.monotonic() < probe.deadline:
                return True
            self.counters["storage_probe_timeouts"] += 1
            self._settle_probe(req_id)
            return False
        self._apply_exists(probe, result)
        self._settle_probe(req_id)
        return False

    def _deadline(self, num_tokens: int) -> tuple[float, float]:
        """(policy wait in s, monotonic deadline); wait_complete's infinite wait is capped
        at an hour so a lost completion can never park a request forever."""
        wait = prefetch_deadline_s(self.cfg, num_tokens)
        return wait, time.monotonic() + (wait if math.isfinite(wait) else 3600.0)

    def _settle_probe(self, req_id: str) -> None:
        self._probes.pop(req_id, None)
        self._probed.add(req_id)

    def _apply_exists(self, probe: _Probe, result: Any) -> None:
        n = len(probe.hashes)
        if result.error is not None or len(result.ok) != 2 * n:
            return
        kv_ok, mamba_ok = result.ok[:n], result.ok[n:]
        prefix = 0
        while prefix < n and kv_ok[prefix]:
            prefix += 1
        if prefix:
            self.tree.mark_storage(probe.hashes, probe.partition, prefix)
        for b in range(1, prefix + 1):
            if mamba_ok[b - 1]:
                self.tree.mark_storage(probe.hashes, probe.partition, b, mamba=True)
        self.counters["storage_blocks_seen"] += prefix

    # -- fetching ----------------------------------------------------------------------
    def start_fetch(
        self, req_id: str, result: Any, hashes: Sequence[bytes], partition: Hashable, tokens: int
    ) -> bool:
        """Reserve host slots for the storage-only part of ``result``; False if impossible."""
        # (kind, slot, block index the object belongs to)
        planned: list[tuple[int, int, int]] = []
        for i in result.storage_blocks:
            slot = self.tree.reserve_kv(hashes, partition, i, from_device=False)
            if slot is None:
                break
            planned.append((KV, slot, i))
        num_kv = len(planned)
        if num_kv == len(result.storage_blocks) and result.mamba_in_storage:
            n = result.num_blocks
            slot = self.tree.reserve_mamba(hashes, partition, n, from_device=False)
            if slot is not None:
                planned.append((MAMBA, slot, n - 1))
        if len(planned) != len(result.storage_blocks) + int(bool(result.mamba_in_storage)):
            self.tree.complete_store(
                [s for k, s, _ in planned if k == KV],
                [s for k, s, _ in planned if k == MAMBA],
                False,
            )
            self.counters["storage_fetch_no_space"] += 1
            return False
        _, deadline = self._deadline(tokens)
        self._fetches[req_id] = _Fetch(deadline, {(k, s) for k, s, _ in planned}, num_blocks=num_kv)
        for kind, slot, index in planned:
            self._owner[(kind, slot)] = (req_id, hashes, partition, index)
            self.fetch_queue.append(FetchItem(kind, hashes[index], slot))
        self.storage_blocks[req_id] = num_kv
        self.counters["storage_fetches"] += 1
        return True

    def _fetch_pending(self, req_id: str) -> bool:
        fetch = self._fetches.get(req_id)
        if fetch is None:
            return False
        if not fetch.outstanding:
            self._fetches.pop(req_id, None)
            if fetch.failed:
                self.storage_blocks.pop(req_id, None)
            return False
        if time.monotonic() >= fetch.deadline:
            # Give up waiting; the fetch still lands in the host tier for later requests.
            self._fetches.pop(req_id, None)
            self.storage_blocks.pop(req_id, None)
            self.counters["storage_fetch_timeouts"] += 1
            return False
        return True

    def fetching(self, req_id: str) -> bool:
        return req_id in self._fetches

    def on_acks(self, acks: dict[tuple[int, int], list[int]], world_size: int) -> None:
        """Worker reports: (kind, slot) -> [ok workers, failed workers]."""
        for (kind, slot), (ok_n, bad_n) in acks.items():
            owner = self._owner.pop((kind, slot), None)
            ok = bad_n == 0 and ok_n >= world_size
            if kind == KV:
                self.tree.complete_store([slot], [], ok=ok)
            else:
                self.tree.complete_store([], [slot], ok=ok)
            self.counters["storage_fetched" if ok else "storage_fetch_failed"] += 1
            if owner is None:
                continue
            req_id, hashes, partition, index = owner
            if not ok:
                # Storage said yes but the bytes were missing or invalid: forget them (and,
                # conservatively, everything stored after them on this path).
                self.tree.evict_storage(hashes, partition, index, None)
            fetch = self._fetches.get(req_id)
            if fetch is not None:
                fetch.outstanding.discard((kind, slot))
                fetch.failed |= not ok

    # -- housekeeping ---------------------------------------------------------------------
    def _drain(self) -> None:
        active = {p.task_id for p in self._probes.values()}
        for res in self.store.poll():
            if res.task_id in active:
                self._results[res.task_id] = res

    def forget(self, req_id: str) -> None:
        probe = self._probes.pop(req_id, None)
        if probe is not None:
            self._results.pop(probe.task_id, None)
        self._probed.discard(req_id)
        self._fetches.pop(req_id, None)
        self.storage_blocks.pop(req_id, None)

    def take_fetches(self) -> list[FetchItem]:
        items, self.fetch_queue = self.fetch_queue, []
        return items

    def yield_to_io(self) -> None:
        """While requests wait on storage, vLLM spins empty steps that hold the GIL the
        store's threads need to finish the very probes and fetches being waited on; a short
        sleep per waiting step hands it over (A/B in docs/BENCHMARKS.md: storage hits
        10-25% faster on a quiet box)."""
        if self._probes or self._fetches:
            time.sleep(YIELD_S)

    def pending(self) -> dict[str, int]:
        return {
            "storage_probes_pending": len(self._probes),
            "storage_fetches_pending": len(self._fetches),
        }
