"""Scheduler half: decides hits, loads, stores and prefetches from vLLM's scheduler hooks.

Rules that keep hybrid hits exact (see shared notes on the connector contract):
- a hit ends at a block boundary P where the host has KV for every block in
  [local hit, P) AND a Mamba state for exactly P; never a KV-only hit. With partial tails
  (``tails``) it may end inside block P instead, at a finished request's last computed
  token, where the host has that block's page and the state after exactly that token;
- P <= num_tokens - 1, since vLLM recomputes the last prompt token and a full
  prompt load would be rewound to a point with no matching state;
- Mamba states are stored only from vLLM's boundary hand-offs (exact block
  ids), never derived positionally;
- every hit is locked in the tree from lookup until the worker reports the load;
- a request whose load failed is never offered a hit again (no retry loops).
The last two are kept by ``hits.HitBook``, which holds every promised and loading hit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from himamba.connector.config import HiMambaConfig
from himamba.connector.layout import HybridLayout
from himamba.connector.protocol import (
    FetchAck,
    LoadJob,
    ObjectKind,
    StepPlan,
    StorageWrite,
    check_plan,
)
from himamba.connector.scheduler.counters import SchedulerCounters
from himamba.connector.scheduler.generations import StorageGenerations
from himamba.connector.scheduler.hits import HitBook
from himamba.connector.scheduler.host_stores import HostStores, block_hashes, request_partition
from himamba.connector.scheduler.lora_identity import LoraTags
from himamba.connector.scheduler.storage_planner import StoragePlanner
from himamba.connector.scheduler.tails import PartialTails
from himamba.connector.tree import HybridRadixTree, MatchResult, invariants_hold
from himamba.tiers.byte_store import ByteStore
from himamba.tiers.storage_config import StorageConfig

# Set (to anything but "0") in tests and debug runs: every step plan is checked for a host
# slot with two roles (``protocol.plan_conflicts``) and an unsafe plan raises.
CHECK_PLANS_ENV = "HIMAMBA_CHECK_PLANS"

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from himamba.connector.observability.kv_events import KVEventTracker


logger = logging.getLogger(__name__)


class SchedulerHalf:
    def __init__(
        self,
        layout: HybridLayout,
        config: HiMambaConfig,
        kv_slots: int,
        mamba_slots: int,
        storage: StoragePlanner | None = None,
    ) -> None:
        self.layout = layout
        self.config = config
        # Metadata budget: vLLM sends no GPU-eviction events and storage presence is learned
        # from probes, so marks of either kind would accumulate forever; past this many nodes the
        # tree drops its least recently used nodes that hold no host bytes.
        self.tree = HybridRadixTree(
            kv_slots, mamba_slots, max_nodes=4 * (kv_slots + mamba_slots) + 1024
        )
        self.counters = SchedulerCounters()
        self.generations = StorageGenerations()
        self.lora = LoraTags()
        self.storage = storage
        # Promised and loading hits, locked until the worker reports their loads.
        self.hits = HitBook(self.tree)
        # Fetch ids a closed planner sent: the next plan cancels them before anything else.
        self._orphan_cancels: list[int] = []
        self.check_plans = os.environ.get(CHECK_PLANS_ENV, "0") not in ("", "0")
        self._plan = StepPlan()
        self._stores_unfenced = False
        # Host objects to write to storage this step (selective write-through, write-back),
        # collected while the step is scheduled and handed to the plan at its end.
        self._writes: list[StorageWrite] = []
        self.stores = HostStores(layout, config, self.tree, self.counters, self.lora)
        self.tails = (
            PartialTails(layout, self.tree, self.counters) if config.partial_tail_hits else None
        )
        # KV-cache events for routers (kv_events.KVEventTracker); None unless vLLM publishes.
        self._events: KVEventTracker | None = None

    @property
    def events(self) -> KVEventTracker | None:
        return self._events

    @events.setter
    def events(self, tracker: KVEventTracker | None) -> None:
        self._events = self.stores.events = tracker

    def new_planner(self, cfg: StorageConfig, store: ByteStore, world_size: int) -> StoragePlanner:
        """A planner over ``store`` in this scheduler's storage generation (a new planner id;
        the epoch and the fetch-id space carry over)."""
        return StoragePlanner(
            cfg,
            store,
            self.tree,
            self.counters,
            self.generations,
            world_size,
            block_size=self.layout.block_size,
            tails=self.tails,
        )

    def attach_storage(self, planner: StoragePlanner) -> None:
        """Storage behind the CPU tier; its write policy decides when host objects reach it."""
        if self.storage is not None:
            self.detach_storage()
        self.storage = planner
        write_back = planner.cfg.write_policy.writes_evictions
        self.tree.write_back = self._write_back if write_back else None
        # Under write-back the worker remembers which slots hold bytes storage lacks; it must
        # hear of every slot the tree frees, or it would later write a reused slot's bytes.
        self.tree.journal_frees = write_back

    def detach_storage(self, close_store: bool = True) -> bool:
        """Stop using storage (run-time control): fetches are abandoned (their slots return at
        once, and the workers are told to cancel them with the next plan), the probe store
        closes (``close_store=False``: the caller closes ``planner.store``, e.g. off the engine
        loop), and lookups serve the CPU tier only. False if none was on."""
        planner, self.storage = self.storage, None
        if planner is None:
            return False
        self.tree.write_back = None
        self._orphan_cancels += planner.close()
        self.generations.detached()
        if not close_store:
            return True
        try:
            planner.store.close()
        except Exception as exc:  # noqa: BLE001 - a failing close must not stop the engine
            logger.warning("himamba: closing the probe store failed: %s", exc)
        return True

    def _write_back(
        self, is_state: bool, slot: int, block_hash: bytes, partition: Hashable = None
    ) -> bool:
        # The tree quarantines the slot until this plan is sealed: the worker reads it first.
        kind = ObjectKind.MAMBA if is_state else ObjectKind.KV
        lora_id = partition[1] if isinstance(partition, tuple) else None
        self._writes.append(StorageWrite(kind, slot, block_hash, self.lora.tag_of_id(lora_id)))
        return True

    # -- lookup ------------------------------------------------------------------
    def _hittable(self, request: Request) -> tuple[list[bytes], int]:
        """(block hashes, deepest boundary a hit may reach: never the last prompt token)."""
        hashes = block_hashes(request, self.layout.hashes_per_block)
        return hashes, min(len(hashes), (request.num_tokens - 1) // self.layout.block_size)

    def on_new_request(self, request: Request) -> None:
        """Probe storage as soon as the request arrives, so its answer is usually back by the
        request's first lookup (no extra engine step), unless the host already covers it."""
        if self.storage is None:
            return
        hashes, max_blocks = self._hittable(request)
        if max_blocks <= 0:
            return
        part = request_partition(request)
        host_blocks = self.tree.match(hashes, part, 0, max_blocks).host_num_blocks
        if self.storage.worth_probing(host_blocks, max_blocks):
            tag = self.lora.tag(request.lora_request)
            self.storage.begin(
                request.request_id,
                hashes[:max_blocks],
                part,
                request.num_tokens,
                tag,
                request.all_token_ids,
            )

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        self.hits.release(req_id)
        bs = self.layout.block_size
        if num_computed_tokens % bs or self.hits.barred(req_id):
            return 0, False
        storage = self.storage
        if storage is not None and storage.still_probing(req_id):
            return None, False  # asked again next step
        hashes, max_blocks = self._hittable(request)
        start = num_computed_tokens // bs
        if max_blocks <= start and (self.tails is None or max_blocks < start):
            # Nothing past vLLM's own hit but maybe a tail (a short next turn, same replica).
            return 0, False
        part = request_partition(request)
        if start:
            self.tree.mark_device(hashes, part, start, mamba=True)
        self.counters.lookups += 1
        result = self.tree.match(hashes, part, start, max_blocks)
        have = max(result.host_num_blocks, start)
        if storage is not None and storage.worth_probing(have, max_blocks):
            if not storage.known(req_id):
                tag = self.lora.tag(request.lora_request)
                storage.begin(
                    req_id,
                    hashes[:max_blocks],
                    part,
                    request.num_tokens,
                    tag,
                    request.all_token_ids,
                )
            changes = storage.tree_changes
            if storage.must_wait(req_id, start, max_blocks):
                return None, False
            if storage.tree_changes != changes:
                result = self.tree.match(hashes, part, start, max_blocks)
        if self.tails is not None:
            deeper = self.tails.deeper_hit(request, hashes, part, start, result.host_num_blocks)
            if deeper is not None:
                return self._promise(request, deeper[0], start, deeper[1])
        return self._promise(request, result, start)

    def _promise(
        self, request: Request, result: MatchResult, start: int, tokens: int | None = None
    ) -> tuple[int, bool]:
        """Promise the host-resident part of ``result`` (storage parts are fetched first);
        ``tokens``: a hit that ends inside its last block (a partial tail)."""
        req_id = request.request_id
        num_blocks = result.host_num_blocks
        if tokens is None:
            tokens = (num_blocks - start) * self.layout.block_size
        if num_blocks <= start or tokens < max(self.config.min_load_tokens, 1):
            self.counters.lookups_missed += 1
            return 0, False
        first_use = self.hits.first_use(req_id)
        if not self.hits.promise(req_id, result, num_blocks, tokens):
            return 0, False
        storage = self.storage
        selective = storage is not None and storage.cfg.write_policy.writes_popular
        if first_use and selective:
            # Written while this hit's lock keeps the slots: popular prefixes reach storage.
            tag = self.lora.tag(request.lora_request)
            for obj in self.tree.hot_objects(result, storage.cfg.write_threshold):
                self._writes.append(StorageWrite(obj.kind, obj.slot, obj.block_hash, tag))
        return tokens, True

    def after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        self.stores.track(request)
        if num_external_tokens == 0:
            self.hits.release(req_id)
            return
        pending = self.hits.take_pending(req_id)
        if pending is None:
            return  # the second call for an async load carries no new work
        result, n = pending.result, pending.num_blocks
        start = result.start_block
        bs = self.layout.block_size
        block_ids = blocks.get_block_ids()
        doomed = None
        if num_external_tokens != pending.tokens:
            doomed = (
                f"vLLM trimmed the hit to {num_external_tokens} tokens; the Mamba state "
                "for that boundary was not planned"
            )
        kv_slots = tuple(result.kv_slots[: n - start])
        kv_blocks = tuple(tuple(block_ids[g.group_id][start:n]) for g in self.layout.attention)
        mamba_blocks = []
        for g in self.layout.mamba:
            row = block_ids[g.group_id]
            mamba_blocks.append(row[n - 1] if len(row) >= n else 0)
        self._plan.loads.append(
            LoadJob(req_id, kv_slots, kv_blocks, pending.mamba_slot, tuple(mamba_blocks), doomed)
        )
        from_storage = 0
        if self.storage is not None:
            from_storage = self.storage.storage_blocks_used(req_id, start, n) * bs
        from_storage = min(from_storage, num_external_tokens)
        self.hits.loading(req_id, pending.handle, num_external_tokens - from_storage, from_storage)
        self.counters.loads += 1
        self.counters.tail_hits += pending.tokens % bs != 0
        self.counters.hit_tokens += num_external_tokens
        self.counters.hit_tokens_storage += from_storage
        if self.events is not None:
            self.events.loaded(request, start, n)

    def hit_sources(self, req_id: str, num_external_tokens: int) -> tuple[int, int]:
        """(host tokens, storage tokens) of a request's external hit (``HitBook.hit_sources``)."""
        return self.hits.hit_sources(req_id, num_external_tokens)

    # -- per step ------------------------------------------------------------------
    def build_plan(self, scheduler_output: SchedulerOutput) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        self.counters.steps += 1
        if self.tails is not None:
            self.tails.drop_overwritten(plan, scheduler_output)  # before any other store joins
        self.stores.plan(plan, scheduler_output)
        storage = self.storage
        plan.engine_idle = not scheduler_output.total_num_scheduled_tokens
        if storage is not None:
            if plan.engine_idle:
                storage.idle_wait()  # only requests waiting on storage: do not spin
            # Before this plan's stores are committed: a fetch reserving slots now can only
            # evict slots of earlier plans, never one this plan stores into.
            plan.fetches, plan.cancels = storage.step()
        if self._orphan_cancels:
            plan.cancels = [*self._orphan_cancels, *plan.cancels]
            self._orphan_cancels = []
        # Stores are committed now: the worker's copy engine runs them in order and settles a
        # slot's store before it lends, writes or overwrites that slot in a later plan.
        if plan.kv_stores or plan.mamba_stores:
            self.tree.complete_store(plan.kv_stores.slots, plan.mamba_stores.slots, ok=True)
        # One more engine step after the last stores even when idle: its fence hands them to
        # storage (write-through would otherwise wait for the next request).
        self._stores_unfenced = bool(plan.kv_stores or plan.mamba_stores)
        plan.storage_writes, self._writes = self._writes, []
        if storage is not None and storage.has_missing():
            self._clear_missing(storage, plan)
        if self.tree.journal_frees:
            plan.freed_kv, plan.freed_mamba = self.tree.take_freed()
        # Slots quarantined while this plan was built (write-back sources) are free again.
        self.tree.seal_plan()
        plan.generation = self.generations.current
        plan.storage_id = "" if storage is None else storage.storage_id
        self.counters.storage_writes_planned += len(plan.storage_writes)
        if self.check_plans:
            check_plan(plan)
        return plan

    def _clear_missing(self, storage: StoragePlanner, plan: StepPlan) -> None:
        """Objects written again this step (on every rank) are no longer known missing."""
        for w in plan.storage_writes:
            storage.wrote(w.kind, w.block_hash)
        if storage.cfg.write_policy.writes_every_store:
            for h in plan.kv_stores.hashes:
                storage.wrote(ObjectKind.KV, h)
            for h in plan.mamba_stores.hashes:
                storage.wrote(ObjectKind.MAMBA, h)

    # -- completion --------------------------------------------------------------
    def on_output(
        self,
        finished_recving: Sequence[str],
        failed_recving: Sequence[str],
        fetch_acks: Sequence[FetchAck] = (),
    ) -> None:
        if fetch_acks and self.storage is not None:
            self.storage.on_acks(fetch_acks)
        failed = set(failed_recving or ())
        for req_id in finished_recving or ():
            if not self.hits.load_done(req_id):
                continue
            if req_id in failed:
                self.counters.loads_failed += 1
                # Never offer this request a hit again (no retry loop). vLLM may already have
                # finished it (policy "fail", or an abort in the same step): then there is
                # nothing to remember.
                if self.stores.is_tracked(req_id):
                    self.hits.bar(req_id)

    def keep_tail(self, request: Request, block_ids: Sequence[Sequence[int]]) -> bool:
        """The request finished: plan the copy of its partial tail (``tails``), which the
        workers make before vLLM can reuse its blocks. True if planned."""
        req_id = request.request_id
        identity = self.stores.identity(req_id)
        if self.tails is None or identity is None:
            return False
        if self.hits.barred(req_id) or self.hits.unsettled(req_id):
            return False  # its blocks may not hold what its token count says
        return self.tails.keep(request, block_ids, *identity, self._plan)

    def on_finished(self, request: Request) -> None:
        req_id = request.request_id
        self.hits.forget(req_id)
        self.stores.forget(req_id)
        if self.storage is not None:
            self.storage.forget(req_id)

    def has_pending_work(self) -> bool:
        """Storage fetches in flight are acknowledged only through engine steps, the last
        step's stores reach storage at the next step's fence, and tails' copies are made in
        the next step."""
        if self._plan.early_stores:
            return True
        if self._stores_unfenced and self.storage is not None:
            return True
        return self.storage is not None and self.storage.has_work()

    def reset(self) -> bool:
        """Make everything cached so far unreachable (vLLM calls this after a weight update).

        Promised hits are dropped, storage fetches are cancelled and the storage key epoch
        changes, so neither the host tier nor storage serves pre-reset bytes afterwards. Loads
        already sent to the workers cannot be called back: while any is unacknowledged the reset
        reports False (vLLM's own reset fails then too), and the caller retries.
        """
        self.hits.release_all()
        if self.tails is not None:
            self.tails.drop_planned(self._plan)  # pre-reset bytes, not under the new epoch
        # The epoch belongs to the scheduler, not to the attached store: a reset while
        # detached still makes everything stored before it unreachable after an attach.
        self.generations.new_epoch()
        if self.storage is not None:
            self.storage.reset()
        self.tree.reset()
        self.counters.resets += 1
        return not self.hits.loads_in_flight()

    def drop_host_tier(self) -> None:
        """Forget the CPU tier and every mark, but keep storage reachable (what a restart does):
        the next request learns from storage again. Unlike ``reset`` nothing becomes stale."""
        self.hits.release_all()
        self.tree.reset()

    def leak_report(self) -> dict[str, int | bool]:
        """What is still held; all zero (and conserved) once the engine is idle."""
        report: dict[str, int | bool] = {
            **self.hits.leak_report(),
            "tracked_requests": len(self.stores),
            "locked_entries": len(self.tree.handles),
            "pending_stores": self.tree.stats()["pending_stores"],
            "slots_conserved": invariants_hold(self.tree),
        }
        if self.storage is not None:
            report.update(self.storage.leak_report())
        return report

    def stats(self) -> dict[str, int]:
        tree = self.tree.stats()
        out = {**self.counters.as_dict(), **tree}
        t = self.tree.counters
        out["host_kv_evictions"] = t.kv_evicted + t.kv_cascaded
        out["host_mamba_evictions"] = t.mamba_evicted + t.mamba_cascaded
        if self.storage is not None:
            out.update(self.storage.stats())
        return out
