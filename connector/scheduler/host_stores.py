"""Device -> host stores: which new full blocks and which Mamba states of each running request
the CPU tier takes this step, and into which reserved host slots.

Its own object because it owns its own state: per request, how far its blocks were stored
and which Mamba states the state budget keeps (``mamba_state.state_budget``). The scheduler
half asks it once per step (``plan``) and tells it when a request starts and ends.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from himamba.connector.config import HiMambaConfig
from himamba.connector.layout import HybridLayout
from himamba.connector.protocol import StepPlan
from himamba.connector.scheduler.counters import SchedulerCounters
from himamba.connector.scheduler.device_blocks import DeviceBlockIds
from himamba.connector.scheduler.lora_identity import LoraTags
from himamba.connector.scheduler.store_due import NEVER, StoreDue
from himamba.connector.tree import HybridRadixTree, StoreCursor
from himamba.mamba_state.state_budget import RequestStates, StateBudget

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput
    from vllm.v1.request import Request

    from himamba.connector.observability.kv_events import KVEventTracker


def block_hashes(request: Request, per_block: int) -> list[bytes]:
    """One hash per scheduler block (the last hash inside it chains the whole prefix).

    Read it during the call, never change or keep it: with one hash per block it is vLLM's
    own list (this runs on every lookup, admission and store; the tree copies what it keeps)."""
    hashes = request.block_hashes
    if per_block == 1:
        return hashes
    # One strided slice (C speed): this runs on every lookup, admission and store run.
    return list(hashes[per_block - 1 : len(hashes) // per_block * per_block : per_block])


def num_hashed_blocks(request: Request, per_block: int) -> int:
    """How many full scheduler blocks have a hash (no copy of the hash list)."""
    return len(request.block_hashes) // per_block


def _by_boundary(entries: list[tuple[int, int, int]]) -> list[tuple[int, dict[int, int]]]:
    """vLLM's ``(group, block, boundary)`` hand-offs of one request as ``(boundary, {group:
    block})``, ascending. Almost always a single boundary: one dict, no sort."""
    if not entries:
        return []
    first = entries[0][2]
    if all(e[2] == first for e in entries):
        return [(first, {g: b for g, b, _ in entries})]
    by: dict[int, dict[int, int]] = defaultdict(dict)
    for group_id, block_id, boundary in entries:
        by[boundary][group_id] = block_id
    return sorted(by.items())


@dataclass
class _Tracked:
    request: Request
    states: RequestStates
    partition: Hashable
    lora_tag: str = ""
    next_store_block: int = 0
    # Where its last store ended in the tree: the next one starts its walk there.
    cursor: StoreCursor = field(default_factory=StoreCursor)


def request_partition(request: Request) -> Hashable:
    """Requests in different partitions never share entries (salt / LoRA)."""
    lora = getattr(request, "lora_request", None)
    return (getattr(request, "cache_salt", None), getattr(lora, "lora_int_id", None))


class HostStores:
    def __init__(
        self,
        layout: HybridLayout,
        config: HiMambaConfig,
        tree: HybridRadixTree,
        counters: SchedulerCounters,
        lora: LoraTags,
    ) -> None:
        self.layout = layout
        self.config = config
        self.tree = tree
        self.counters = counters
        self.lora = lora
        self.budget = StateBudget(layout.block_size, config.checkpoint_interval_tokens)
        self.events: KVEventTracker | None = None
        self.device_blocks = DeviceBlockIds([g.group_id for g in layout.attention])
        self._mamba_groups = [g.group_id for g in layout.mamba]
        self._tracked: dict[str, _Tracked] = {}
        # Per tracked request: the computed-token count at which its block
        # ``next_store_block`` is full, and which requests can have reached it this step.
        self.due = StoreDue()

    def track(self, request: Request) -> None:
        """The request was scheduled: from now on its new blocks and states may be stored."""
        if request.request_id in self._tracked:
            return
        per_block = self.layout.hashes_per_block
        part = request_partition(request)
        known = self.tree.depth(block_hashes(request, per_block), part)
        states = self.budget.open(request.num_prompt_tokens, known)
        tag = self.lora.tag(request.lora_request)
        tracked = _Tracked(request, states, part, lora_tag=tag)
        self._tracked[request.request_id] = tracked
        self.due.watch(request.request_id, request.num_prompt_tokens)
        self._stored_through(tracked, 0, self._last_block(request), None)

    def _stored_through(
        self, tracked: _Tracked, block: int, last_block: int | None, done: int | None
    ) -> None:
        """Blocks before ``block`` are stored; ``last_block`` caps what ever may be; the
        request has ``done`` computed tokens at this step's end (None: not known here)."""
        tracked.next_store_block = block
        finished = last_block is not None and block >= last_block
        at = NEVER if finished else (block + 1) * self.layout.block_size
        self.due.set(tracked.request.request_id, at, done)

    def _last_block(self, request: Request) -> int | None:
        """The block count a request's stores stop at (its prompt's, without decode stores)."""
        if self.config.store_decode_blocks:
            return None
        return request.num_prompt_tokens // self.layout.block_size

    def identity(self, req_id: str) -> tuple[Hashable, str] | None:
        """(partition, LoRA tag) of a tracked request: what its stores are keyed under."""
        tracked = self._tracked.get(req_id)
        return None if tracked is None else (tracked.partition, tracked.lora_tag)

    def is_tracked(self, req_id: str) -> bool:
        return req_id in self._tracked

    def forget(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)
        self.due.forget(req_id)

    def __len__(self) -> int:
        return len(self._tracked)

    def plan(self, plan: StepPlan, scheduler_output: SchedulerOutput) -> None:
        """Reserve host slots for this step's stores and add them to ``plan``."""
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if block_state is None:
            self.due.step(scheduler_output)  # nothing to store, but the clock must advance
            return
        finished = set(scheduler_output.finished_req_ids)
        self._plan_kv(plan, scheduler_output, block_state, finished)
        self._plan_mamba(plan, block_state.boundary_state_offloads)

    def _plan_kv(
        self,
        plan: StepPlan,
        so: SchedulerOutput,
        block_state: KVConnectorBlockState,
        finished: set[str],
    ) -> None:
        bs = self.layout.block_size
        per_block = self.layout.hashes_per_block
        for req_id, done in self.due.step(so):
            if req_id in finished:
                continue
            tracked = self._tracked[req_id]
            request = tracked.request
            last = self._last_block(request)
            full = min(num_hashed_blocks(request, per_block), done // bs)
            if last is not None:
                full = min(full, last)
            if full <= tracked.next_store_block:
                continue
            start = tracked.next_store_block
            attention = self.device_blocks.rows(block_state, req_id, start, full)
            if attention is None:
                continue
            hashes = block_hashes(request, per_block)
            part = tracked.partition
            rolled_back: list[int] = []
            kept: list[tuple[int, int]]
            tag = tracked.lora_tag
            events = self.events
            failures = self.tree.counters.alloc_failures
            # Every slot of the run is committed (build_plan) or rolled back (below) in this
            # plan, and that settles the path.
            run = self.tree.reserve_kv_run(
                hashes, part, start, full, commit_settles=True, cursor=tracked.cursor
            )
            lo, hi = (run[0][0], run[-1][0] + 1) if run else (0, 0)
            columns = [row[lo - start : hi - start] for row in attention]
            if (
                run
                and hi - lo == len(run)
                and all(len(c) == hi - lo and 0 not in c for c in columns)
            ):
                # The usual run, one contiguous span with a device block everywhere: slices,
                # not a Python step per block.
                kept = run
                plan.kv_stores.extend([s for _, s in run], columns, hashes[lo:hi], tag)
            else:
                kept, rolled_back = self._split_missing(run, attention, start)
                idx = [i for i, _ in kept]
                if idx:
                    plan.kv_stores.extend(
                        [s for _, s in kept],
                        [[row[i - start] for i in idx] for row in attention],
                        [hashes[i] for i in idx],
                        tag,
                    )
            if kept:
                self.counters.kv_blocks_stored += len(kept)
                if events is not None:
                    for i, _ in kept:
                        events.planned_kv(request, i, hashes[i])
            if rolled_back:
                self.tree.complete_store(rolled_back, [], ok=False)
            if self.tree.counters.alloc_failures == failures:
                self._stored_through(tracked, full, last, done)
            else:
                # The tier had no room past the last reserved block: try the rest next step
                # rather than skip it for good.
                self._stored_through(tracked, run[-1][0] + 1 if run else start, last, done)

    @staticmethod
    def _split_missing(
        run: list[tuple[int, int]], attention: list[list[int]], start: int
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """(blocks to store, slots to roll back): a block with no device block in some
        attention group (id 0) has nothing to copy from. ``attention`` rows begin at
        block ``start``."""
        kept, rolled_back = [], []
        for i, slot in run:
            if all(row[i - start] for row in attention):
                kept.append((i, slot))
            else:
                rolled_back.append(slot)
        return kept, rolled_back

    def _plan_mamba(self, plan: StepPlan, offloads: dict[str, list[tuple[int, int, int]]]) -> None:
        bs = self.layout.block_size
        mamba_groups = self._mamba_groups
        for req_id, entries in offloads.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            hashed = num_hashed_blocks(tracked.request, self.layout.hashes_per_block)
            hashes: list[bytes] | None = None  # built once a state is really reserved
            for boundary, per_group in _by_boundary(entries):
                n = boundary // bs
                # Partial-tail (sub-block) states are not hittable at block granularity.
                if boundary % bs or n == 0 or n > hashed:
                    continue
                blocks = [per_group.get(g, 0) for g in mamba_groups]
                if 0 in blocks:
                    self.counters.mamba_incomplete_handoffs += 1
                    continue
                if boundary > tracked.states.prompt_end and not self.config.store_decode_blocks:
                    # Its KV blocks are not stored: the state alone could never be hit.
                    self.counters.mamba_states_skipped += 1
                    continue
                keep, replaces = self.budget.decide(tracked.states, boundary)
                if not keep:
                    self.counters.mamba_states_skipped += 1
                    continue
                if hashes is None:
                    hashes = block_hashes(tracked.request, self.layout.hashes_per_block)
                part = tracked.partition
                slot = self.tree.reserve_mamba(hashes, part, n, cursor=tracked.cursor)
                if slot is None:
                    continue  # nothing stored: the budget's book stays as it was
                plan.mamba_stores.add(slot, blocks, hashes[n - 1], tracked.lora_tag)
                self.counters.mamba_states_stored += 1
                self.budget.stored(tracked.states, boundary)
                if self.events is not None:
                    self.events.planned_state(tracked.request, n, hashes[n - 1])
                if replaces and self.tree.drop_state(hashes, part, replaces // bs):
                    self.counters.mamba_states_replaced += 1
