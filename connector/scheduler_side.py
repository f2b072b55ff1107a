"""Scheduler half: decides hits, loads and stores from vLLM's scheduler hooks.

Rules that keep hybrid hits exact (see shared notes on the connector contract):
- a hit ends at a block boundary P where the host has KV for every block in
  [local hit, P) AND a Mamba state for exactly P; never a KV-only hit;
- P <= num_tokens - 1, since vLLM recomputes the last prompt token and a full
  prompt load would be rewound to a point with no matching state;
- Mamba states are stored only from vLLM's boundary hand-offs (exact block
  ids), never derived positionally;
- every hit is locked from lookup until the worker reports the load done.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from himamba.connector.config import HiMambaConfig
from himamba.connector.host_index import HostIndex, LockHandle, MatchResult
from himamba.connector.jobs import LoadJob, StepPlan
from himamba.connector.layout import HybridLayout

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A hit promised to vLLM and locked, waiting for its blocks."""

    result: MatchResult
    handle: LockHandle
    local_tokens: int


@dataclass
class _Tracked:
    request: Any
    next_store_block: int = 0


def request_partition(request: Any) -> Hashable:
    """Requests in different partitions never share entries (salt / LoRA)."""
    lora = getattr(request, "lora_request", None)
    return (getattr(request, "cache_salt", None), getattr(lora, "lora_int_id", None))


class SchedulerHalf:
    def __init__(
        self, layout: HybridLayout, config: HiMambaConfig, kv_slots: int, mamba_slots: int
    ) -> None:
        self.layout = layout
        self.config = config
        self.index = HostIndex(kv_slots, mamba_slots)
        self._tracked: dict[str, _Tracked] = {}
        self._pending: dict[str, _Pending] = {}
        self._inflight: dict[str, LockHandle] = {}
        self._plan = StepPlan()
        self.counters: dict[str, int] = defaultdict(int)

    # -- hashing -----------------------------------------------------------------
    def block_hashes(self, request: Any) -> list[bytes]:
        """One hash per scheduler block (the last hash inside it chains the whole prefix)."""
        hashes = request.block_hashes
        r = self.layout.hashes_per_block
        if r == 1:
            return list(hashes)
        return [hashes[(i + 1) * r - 1] for i in range(len(hashes) // r)]

    # -- lookup ------------------------------------------------------------------
    def lookup(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        req_id = request.request_id
        self._release_pending(req_id)
        self.counters["lookups"] += 1
        bs = self.layout.block_size
        if num_computed_tokens % bs:
            return 0, False
        hashes = self.block_hashes(request)
        max_blocks = min(len(hashes), (request.num_tokens - 1) // bs)
        start = num_computed_tokens // bs
        if max_blocks <= start:
            return 0, False
        result = self.index.match(hashes, request_partition(request), start, max_blocks)
        tokens = (result.num_blocks - start) * bs
        if not result.hit or tokens < max(self.config.min_load_tokens, 1):
            return 0, False
        handle = self.index.lock(result)
        self._pending[req_id] = _Pending(result, handle, num_computed_tokens)
        return tokens, True

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        self._tracked.setdefault(req_id, _Tracked(request))
        pending = self._pending.pop(req_id, None)
        if num_external_tokens == 0:
            if pending is not None:
                self.index.unlock(pending.handle)
            return
        if pending is None:
            # A second call for an async load carries the same count; ignore it.
            return
        result = pending.result
        bs = self.layout.block_size
        block_ids = blocks.get_block_ids()
        doomed = None
        if num_external_tokens != (result.num_blocks - result.start_block) * bs:
            doomed = (
                f"vLLM trimmed the hit to {num_external_tokens} tokens; the Mamba state "
                "for that boundary was not planned"
            )
        kv_blocks = [
            list(block_ids[g.group_id][result.start_block : result.num_blocks])
            for g in self.layout.attention
        ]
        mamba_blocks = []
        for g in self.layout.mamba:
            row = block_ids[g.group_id]
            mamba_blocks.append(row[result.num_blocks - 1] if len(row) >= result.num_blocks else 0)
        self._plan.loads.append(
            LoadJob(req_id, result.kv_slots, kv_blocks, result.mamba_slot, mamba_blocks, doomed)
        )
        self._inflight[req_id] = pending.handle
        self.counters["loads"] += 1
        self.counters["hit_tokens"] += num_external_tokens
        # The next stores for this request start past what we just loaded.
        self._tracked[req_id].next_store_block = result.num_blocks

    # -- per step ------------------------------------------------------------------
    def build_plan(self, scheduler_output: Any) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        finished = set(scheduler_output.finished_req_ids)
        self._plan_kv_stores(plan, scheduler_output, block_state, finished)
        if block_state is not None:
            self._plan_mamba_stores(plan, block_state.boundary_state_offloads, block_state)
        return plan

    def _computed_before_step(self, scheduler_output: Any) -> dict[str, int]:
        out = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        out.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return out

    def _plan_kv_stores(
        self, plan: StepPlan, so: Any, block_state: Any, finished: set[str]
    ) -> None:
        if block_state is None:
            return
        bs = self.layout.block_size
        computed = self._computed_before_step(so)
        for req_id, num_new in so.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None or req_id in finished or req_id not in computed:
                continue
            request = tracked.request
            hashes = self.block_hashes(request)
            full = min(len(hashes), (computed[req_id] + num_new) // bs)
            if not self.config.store_decode_blocks:
                full = min(full, request.num_prompt_tokens // bs)
            if full <= tracked.next_store_block:
                continue
            block_ids = block_state.get_block_ids(req_id)
            if block_ids is None:
                continue
            part = request_partition(request)
            for i in range(tracked.next_store_block, full):
                group_blocks = [block_ids[g.group_id][i] for g in self.layout.attention]
                if any(b == 0 for b in group_blocks):
                    continue
                slot = self.index.reserve_kv(hashes, part, i)
                if slot is not None:
                    plan.kv_stores.add(slot, group_blocks)
                    self.counters["kv_blocks_stored"] += 1
            tracked.next_store_block = full

    def _plan_mamba_stores(
        self, plan: StepPlan, offloads: dict[str, list[tuple[int, int, int]]], block_state: Any
    ) -> None:
        bs = self.layout.block_size
        mamba_groups = [g.group_id for g in self.layout.mamba]
        for req_id, entries in offloads.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            by_boundary: dict[int, dict[int, int]] = defaultdict(dict)
            for group_id, block_id, boundary in entries:
                by_boundary[boundary][group_id] = block_id
            hashes = self.block_hashes(tracked.request)
            part = request_partition(tracked.request)
            for boundary, per_group in sorted(by_boundary.items()):
                n = boundary // bs
                # Partial-tail (sub-block) states are not hittable at block granularity.
                if boundary % bs or n == 0 or n > len(hashes):
                    continue
                if any(g not in per_group or per_group[g] == 0 for g in mamba_groups):
                    self.counters["mamba_incomplete_handoffs"] += 1
                    continue
                slot = self.index.reserve_mamba(hashes, part, n)
                if slot is not None:
                    plan.mamba_stores.add(slot, [per_group[g] for g in mamba_groups])
                    self.counters["mamba_states_stored"] += 1

    # -- completion --------------------------------------------------------------
    def on_output(self, finished_recving: Sequence[str], failed_recving: Sequence[str]) -> None:
        failed = set(failed_recving or ())
        for req_id in finished_recving or ():
            handle = self._inflight.pop(req_id, None)
            if handle is None:
                continue
            self.index.unlock(handle)
            if req_id in failed:
                self.counters["loads_failed"] += 1
                self.index.invalidate(handle)

    def on_finished(self, request: Any) -> None:
        req_id = request.request_id
        self._release_pending(req_id)
        self._tracked.pop(req_id, None)

    def reset(self) -> bool:
        self.index.reset()
        return True

    def _release_pending(self, req_id: str) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            self.index.unlock(pending.handle)

    def leak_report(self) -> dict[str, int | bool]:
        """What is still held; all zero (and conserved) once the engine is idle."""
        return {
            "pending_hits": len(self._pending),
            "inflight_loads": len(self._inflight),
            "tracked_requests": len(self._tracked),
            "locked_entries": self.index.locked_entries(),
            "slots_conserved": self.index.conserved(),
        }

    def stats(self) -> dict[str, int]:
        return {**self.counters, **self.index.stats()}
