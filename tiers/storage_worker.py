"""Worker-side storage traffic: write-through of fresh host slots, fetches into reserved slots.

Runs inside vLLM's worker, so nothing here may block: it submits to the store
and drains completions once per step. Fetched bytes are written into their host
slot only after the store validated them (header, size, checksum), and each
fetch is acknowledged to the scheduler, which alone decides what becomes hittable.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.object_format import ObjectKind, StorageKey, stored_size

logger = logging.getLogger(__name__)


class StorageWorker:
    def __init__(
        self,
        store: Any,
        pools: dict[int, HostSlotPool],
        capacity_bytes: int | None,
        write_through: bool,
    ) -> None:
        self.store = store
        self.pools = pools  # kind -> pool
        self.capacity_bytes = capacity_bytes
        self.write_through = write_through
        self._gets: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        self._puts: dict[int, list[StorageKey]] = {}
        # Objects this process wrote, oldest first: the LRU that capacity_gb evicts from.
        self._lru: OrderedDict[StorageKey, int] = OrderedDict()
        self._lru_bytes = 0
        self.acks: dict[tuple[int, int], list[int]] = {}
        self.counters: dict[str, float] = {
            "storage_puts_ok": 0,
            "storage_puts_failed": 0,
            "storage_gets_ok": 0,
            "storage_gets_failed": 0,
            "storage_bytes_written": 0,
            "storage_bytes_read": 0,
            "storage_evictions": 0,
        }

    def write_through_slots(self, kind: int, slots: Sequence[int], hashes: Sequence[bytes]) -> None:
        if not self.write_through or not slots:
            return
        pool = self.pools[kind]
        keys = [StorageKey(h, ObjectKind(kind)) for h in hashes]
        # read_slot copies: the pool slot may be reused before the put finishes.
        payloads = [pool.read_slot(s) for s in slots]
        tid = self.store.submit_put(keys, payloads)
        self._puts[tid] = keys

    def fetch(self, items: Sequence[Any]) -> None:
        if not items:
            return
        keys, plan = [], []
        for it in items:
            pool = self.pools[it.kind]
            keys.append(StorageKey(it.block_hash, ObjectKind(it.kind)))
            plan.append((it.kind, it.slot, torch.empty(pool.slot_bytes, dtype=torch.uint8)))
        tid = self.store.submit_get(keys, [dst for _, _, dst in plan])
        self._gets[tid] = plan

    def poll(self) -> None:
        for res in self.store.poll():
            plan = self._gets.pop(res.task_id, None)
            if plan is not None:
                self._finish_get(plan, res)
                continue
            keys = self._puts.pop(res.task_id, None)
            if keys is not None:
                self._finish_put(keys, res)

    def _finish_get(self, plan: list[tuple[int, int, torch.Tensor]], res: Any) -> None:
        for i, (kind, slot, dst) in enumerate(plan):
            ok = res.error is None and i < len(res.ok) and res.ok[i]
            if ok:
                self.pools[kind].write_slot(slot, dst)
                self.counters["storage_gets_ok"] += 1
                self.counters["storage_bytes_read"] += dst.numel()
            else:
                self.counters["storage_gets_failed"] += 1
            counts = self.acks.setdefault((kind, slot), [0, 0])
            counts[0 if ok else 1] += 1

    def _finish_put(self, keys: list[StorageKey], res: Any) -> None:
        for i, key in enumerate(keys):
            ok = res.error is None and i < len(res.ok) and res.ok[i]
            if not ok:
                self.counters["storage_puts_failed"] += 1
                continue
            size = stored_size(self.pools[int(key.kind)].slot_bytes)
            self.counters["storage_puts_ok"] += 1
            self.counters["storage_bytes_written"] += size
            if key not in self._lru:
                self._lru[key] = size
                self._lru_bytes += size
            self._lru.move_to_end(key)
        self._evict_over_capacity()

    def _evict_over_capacity(self) -> None:
        if self.capacity_bytes is None or self._lru_bytes <= self.capacity_bytes:
            return
        victims = []
        while self._lru and self._lru_bytes > self.capacity_bytes:
            key, size = self._lru.popitem(last=False)
            self._lru_bytes -= size
            victims.append(key)
        self.store.submit_delete(victims)
        self.counters["storage_evictions"] += len(victims)

    def take_acks(self) -> dict[tuple[int, int], list[int]]:
        acks, self.acks = self.acks, {}
        return acks

    def flush(self, timeout_s: float) -> bool:
        """Wait (bounded) for submitted puts and gets, e.g. before a graceful shutdown."""
        deadline = time.monotonic() + timeout_s
        while (self._puts or self._gets) and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.005)
        return not (self._puts or self._gets)

    def close(self, flush_timeout_s: float = 5.0) -> None:
        # Let write-through land first: a graceful restart should find what it computed.
        self.flush(flush_timeout_s)
        self.store.close()
