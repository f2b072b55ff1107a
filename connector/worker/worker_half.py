"""Worker half: owns the host slot pools and moves bytes as the scheduler's plan says.

It never decides anything: every slot and block id comes from the scheduler
half. Bytes move on the copy engine (``tiers.transfer_engine``), off the step:
stores are submitted in ``wait_for_save`` and fenced at the next step's first hook
(``handle_preemptions``, see ``copy_jobs``), except partial tails, copied in that first hook
itself (their blocks were freed before the step: ``run_early_stores``); loads are submitted in ``start_load_kv``
and reported through ``finished_recving`` once done (on CPU, where the forward and
the copies share the cores, within the step; on a GPU when their event fired).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from himamba.connector.layout import GroupLayout, HybridLayout
from himamba.connector.observability.metrics import StatsRecorder
from himamba.connector.protocol import (
    ControlRequest,
    FetchAck,
    LoadJob,
    ObjectKind,
    StepPlan,
    StoreBatch,
    StoredBatch,
    StoreDone,
)
from himamba.connector.worker.copy_jobs import CopyJobs
from himamba.connector.worker.counters import CopyCounters
from himamba.connector.worker.worker_storage import WorkerStorage
from himamba.mamba_state.snapshot import NULL_BLOCK, MambaSnapshotter
from himamba.tiers.cpu_pool import HostSlotPool, spare_slots
from himamba.tiers.object_format import HEADER_SIZE
from himamba.tiers.transfer import CopyPlan, LayerBlocks, plan_copies
from himamba.tiers.transfer_engine import make_copy_engine

# A step that runs no forward (vLLM scheduled nothing: its requests wait on storage) while
# fetches are outstanding blocks, GIL released, until the oldest fetch's result is in, at most
# IDLE_FETCH_WAIT_S; the engine would otherwise spin empty steps that take the CPU and the GIL
# from the very threads reading those bytes. bench_fleet, 39 fetches of ~7 MB per arm: median
# 49.6 -> 37.3 ms with the wait (docs/BENCHMARKS.md). A request arriving meanwhile waits as
# long at most, as for the scheduler's probe wait. A step that runs a forward but moves no
# host bytes only yields IDLE_YIELD_S, so other requests' tokens are not held back.
IDLE_FETCH_WAIT_S = 0.02
IDLE_YIELD_S = 0.0005

logger = logging.getLogger(__name__)


class RunnerOrder(enum.Enum):
    """When vLLM's model runner writes a step's new blocks (zeroing, CoW and Mamba copies)
    relative to our first hook of the step, which fences stores and copies partial tails."""

    # Model Runner V1: ``handle_preemptions`` comes before any block write.
    HOOK_FIRST = "v1"
    # Model Runner V2 with our step-start hook (``runner_v2_hook``): it runs ``step_start``
    # before V2's body, and ``handle_preemptions`` then skips what already ran.
    STEP_HOOK = "v2+step-hook"
    # Model Runner V2 without it: blocks are written first, so a copy engine the device does
    # not order finishes stores within the step, and tails arrive screened by the scheduler.
    BLOCKS_FIRST = "v2"

    @classmethod
    def of(cls, runner_v2: bool, hook_installed: bool) -> RunnerOrder:
        if not runner_v2:
            return cls.HOOK_FIRST
        return cls.STEP_HOOK if hook_installed else cls.BLOCKS_FIRST


class WorkerHalf:
    def __init__(
        self,
        layout: HybridLayout,
        kv_slots: int,
        mamba_slots: int,
        open_storage: Callable[[dict[int, HostSlotPool]], WorkerStorage] | None = None,
        rank: int = 0,
    ) -> None:
        self.layout = layout
        self._open_storage = open_storage
        self.storage: WorkerStorage | None = None
        self.rank = rank
        # Acknowledgements of fetches this worker could not run (storage detached): every
        # fetch must be acknowledged by every rank, or its slots wait for the ack timeout.
        self._orphan_acks: list[FetchAck] = []
        # Run-time storage switches to report to the scheduler half (connector.control).
        self.control_out: list[ControlRequest] = []
        self.kv_slots = kv_slots
        self.mamba_slots = mamba_slots
        self.kv_layers: list[LayerBlocks] = []
        self.kv_pool: HostSlotPool | None = None
        self.mamba: MambaSnapshotter | None = None
        self.copies: CopyJobs | None = None
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._idle_step = False
        self._engine_idle = False
        # The plan whose storage prelude already ran this step (early stores run it first).
        self._prelude_of: StepPlan | None = None
        # Set by the connector from vLLM's config and whether the V2 hook went in.
        self.runner_order = RunnerOrder.HOOK_FIRST
        self._started: StepPlan | None = None
        self.counters = CopyCounters()
        # Per-operation observations for the Prometheus histograms (connector.stats drains it).
        self.recorder = StatsRecorder()
        # Set by the connector when vLLM publishes KV events: storage outcomes are then kept.
        self.record_storage_events = False

    # -- setup ---------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.layout.num_gpu_blocks
        self.kv_layers = self._wrap(self.layout.attention, kv_caches, num_blocks)
        mamba_layers = self._wrap(self.layout.mamba, kv_caches, num_blocks)
        pin = any(t.tensor.is_cuda for t in self.kv_layers) and torch.cuda.is_available()
        self.kv_pool = _pool([t.block_bytes for t in self.kv_layers], self.kv_slots, pin)
        mamba_pool = _pool([t.block_bytes for t in mamba_layers], self.mamba_slots, pin)
        self.mamba = MambaSnapshotter(
            mamba_layers, [len(g.layer_names) for g in self.layout.mamba], mamba_pool
        )
        on_cuda = any(t.tensor.is_cuda for t in self.kv_layers + mamba_layers)
        self.copies = CopyJobs(make_copy_engine(on_cuda), self.counters, self.recorder)
        logger.info(
            "himamba: host tier %d KV slots x %d B + %d Mamba slots x %d B (%.2f GiB)",
            self.kv_slots,
            self.kv_pool.slot_bytes,
            self.mamba_slots,
            mamba_pool.slot_bytes,
            (self.kv_pool.nbytes + mamba_pool.nbytes) / (1 << 30),
        )
        if self._open_storage is not None:
            self._attach(self._open_storage)

    # -- storage switches (connector.control) -----------------------------------------
    def _attach(self, opener: Callable[[dict[int, HostSlotPool]], WorkerStorage]) -> None:
        assert self.kv_pool is not None and self.mamba is not None
        self.storage = opener({ObjectKind.KV: self.kv_pool, ObjectKind.MAMBA: self.mamba.pool})
        assert self.copies is not None
        if not self.copies.engine.overlaps_compute:
            # On CPU a write's copy into store memory runs on the copy thread, overlapping the
            # next forward; FIFO order keeps it ahead of any later store into the same slots.
            self.storage.stage_later = self.copies.submit_call
        if self.record_storage_events:
            self.storage.outcomes = []

    def attach_storage(self, opener: Callable[[dict[int, HostSlotPool]], WorkerStorage]) -> None:
        self.detach_storage()
        self._open_storage = opener
        if self.kv_pool is not None:  # before register_kv_caches it opens there
            self._attach(opener)

    def detach_storage(self) -> None:
        """Stop using storage now: running fetches are acknowledged as failed (their slots go
        back to the scheduler), pending writes are flushed, the store is closed."""
        self._open_storage = None
        self.settle()
        if self.storage is not None:
            self._orphan_acks += self.storage.abort_fetches()
            self.storage.close()
            self.storage = None

    def take_acks(self) -> list[FetchAck]:
        acks, self._orphan_acks = self._orphan_acks, []
        if self.storage is not None:
            acks += self.storage.take_acks()
        return acks

    @staticmethod
    def _wrap(
        groups: tuple[GroupLayout, ...], kv_caches: dict[str, Any], num_blocks: int
    ) -> list[LayerBlocks]:
        layers = []
        for group in groups:
            for name in group.layer_names:
                cache = kv_caches.get(name)
                if cache is None:
                    raise RuntimeError(f"himamba: vLLM registered no KV cache for layer {name}")
                if isinstance(cache, (list, tuple)):
                    raise RuntimeError(
                        f"himamba: layer {name} has a list of caches; expected one page tensor"
                    )
                layer = LayerBlocks.wrap(name, cache, num_blocks)
                # The slot layout was sized from the spec's real (unpadded) bytes in the
                # scheduler process; a view of any other size would misplace every byte.
                if layer.block_bytes != group.layer_block_bytes:
                    raise RuntimeError(
                        f"himamba: layer {name} has {layer.block_bytes} B per block, its spec "
                        f"says {group.layer_block_bytes} B (padded views are unsupported)"
                    )
                layers.append(layer)
        return layers

    # -- per step --------------------------------------------------------------
    def fence(self) -> None:
        """Called before vLLM can rewrite any block of this step. On CPU it waits for every
        store still copying (not for the storage writes they start); on a GPU the device
        already orders them (the compute stream waits for each store's event), so it only hands
        the completed ones on (``_stores_done``)."""
        if self.copies is None:
            return
        if self.copies.engine.overlaps_compute:
            self._stores_done(self.copies.reap_stores())
        else:
            # The writes these stores start copy on the copy thread, during the forward.
            self._stores_done(self.copies.wait_stores())

    def settle(self) -> None:
        """Wait for every store still copying, on any engine: before host slots are read on
        this thread's behalf (storage writes of host objects), before storage is flushed,
        detached or closed, and in an idle step (so the last stores reach storage)."""
        if self.copies is not None:
            self._stores_done(self.copies.wait_stores())
            # Writes' copies out of host slots: done before a slot is lent to the adapter.
            self.copies.wait_calls()

    def flush_storage(self, timeout_s: float = 30.0) -> bool:  # graceful shutdown, tests
        """Hand every finished copy to storage and wait until storage has written it all."""
        self.settle()
        return self.storage is None or self.storage.flush(timeout_s)

    def _stores_done(self, stores: list[StoreDone]) -> None:
        """Completed stores: the stored objects go on to storage."""
        if self.storage is None:
            return
        for done in stores:
            for batch in done.batches:
                self.storage.on_stored(
                    batch.kind, batch.slots, batch.hashes, done.epoch, batch.lora_tags
                )

    def _storage_prelude(self, plan: StepPlan) -> None:
        """What must precede any copy of ``plan`` into host slots: the last stores complete,
        then the plan's cancels (the scheduler may reuse a cancelled fetch's slots in this
        very plan), writes of host objects (before this plan's stores or fetches overwrite
        them) and the slots the scheduler freed (their bytes no longer belong to any key)."""
        # A slot's last store must be complete (and handed to storage) before a storage write
        # reads the slot or a fetch lends it to the adapter; an idle step hands the last
        # stores on. Otherwise a no-op on CPU, where handle_preemptions fenced already.
        if plan.storage_writes or plan.fetches or plan.is_empty():
            self.settle()
        else:
            self.fence()
        if self.storage is not None:
            self.storage.cancel(plan.cancels)
            self.storage.write_slots(plan.storage_writes, plan.epoch)
            self.storage.forget_slots(ObjectKind.KV, plan.freed_kv)
            self.storage.forget_slots(ObjectKind.MAMBA, plan.freed_mamba)
        self._prelude_of = plan

    def run_loads(self, plan: StepPlan) -> None:
        if self._prelude_of is not plan:
            self._storage_prelude(plan)
        self._prelude_of = None
        self._idle_step = not plan.moves_bytes()
        self._engine_idle = plan.engine_idle
        if self.storage is None:
            # Detached while the scheduler still planned fetches: fail them back at once.
            self._orphan_acks += [
                FetchAck(o.fetch_id, o.generation.planner, self.rank, (False,) * len(o.items))
                for o in plan.fetches
            ]
        else:
            self.storage.fetch(plan.fetches)
        assert self.copies is not None
        for job in plan.loads:
            try:
                plans = self._plan_load(job)
            except Exception as exc:  # noqa: BLE001 - any failure must become a recompute
                logger.warning("himamba: load for %s failed: %s", job.req_id, exc)
                self.counters.loads_failed += 1
                self._finished.add(job.req_id)
                self._failed.add(job.req_id)
                continue
            self.copies.submit_load(job.req_id, plans)

    def _plan_load(self, job: LoadJob) -> list[CopyPlan]:
        """Check every id now (a bad plan fails this request alone), copy later."""
        if job.doomed:
            raise RuntimeError(job.doomed)
        assert self.kv_pool is not None and self.mamba is not None
        self._check_slots(job.kv_slots, self.kv_slots)
        self._check_slots([job.mamba_slot], self.mamba_slots)
        for blocks in job.kv_blocks:
            self._check_blocks(blocks, len(job.kv_slots))
        plans = []
        if job.kv_slots:
            per_layer = self._kv_per_layer(job.kv_blocks)
            plans.append(plan_copies(self.kv_layers, per_layer, self.kv_pool, job.kv_slots, False))
        plans.append(self.mamba.plan_restore([[b] for b in job.mamba_blocks], [job.mamba_slot]))
        return plans

    def step_start(self, plan: StepPlan | None) -> None:
        """Before vLLM rewrites any block this step: the last step's stores have read their
        blocks, and this plan's partial tails are copied."""
        self.fence()
        if plan is not None:
            self.run_early_stores(plan)
        self._started = plan

    def first_hook(self, plan: StepPlan | None) -> None:
        """``handle_preemptions``: the step start, unless V2's hook ran it for this plan."""
        started, self._started = self._started, None
        order = self.runner_order
        if order is RunnerOrder.STEP_HOOK and plan is not None and started is plan:
            return
        if plan is not None and plan.early_stores:
            if order is RunnerOrder.STEP_HOOK:
                # The hook did not run before vLLM's block writes this step: a tail copied now
                # could hold another request's bytes. A vLLM whose runner changed shape.
                raise RuntimeError(
                    "himamba: Model Runner V2 reached handle_preemptions without the step-start "
                    "hook; set HIMAMBA_V2_STEP_HOOK=0 (partial tails then stay exact)"
                )
            if order is RunnerOrder.BLOCKS_FIRST and not plan.tails_screened:
                # The scheduler believed V2's hook was here: its tails' blocks may be rewritten.
                raise RuntimeError(
                    "himamba: the scheduler planned partial tails for a Model Runner V2 worker "
                    "without the step-start hook; set HIMAMBA_V2_STEP_HOOK=0 for every process"
                )
        self.step_start(plan)

    def run_early_stores(self, plan: StepPlan) -> None:
        """Copy the plan's early stores (partial tails) now, in the step's first hook: their
        blocks are vLLM's again and may be zeroed or rewritten later in this very step. On CPU
        this waits for the copy; on a GPU later compute waits for it on the device."""
        if not plan.early_stores:
            return
        self._storage_prelude(plan)  # e.g. a cancelled fetch's slot, now a tail's, first
        kv, _ = plan.kv_stores.split(plan.early_stores)
        mamba, _ = plan.mamba_stores.split(plan.early_stores)
        self._submit_stores(kv, mamba, plan.epoch)
        self.fence()

    def run_stores(self, plan: StepPlan) -> None:
        """Submit this step's device -> host copies; they complete off the step (see fence),
        except where the runner zeroes the next step's new blocks (possibly these) before
        the fence in its first hook and no device stream orders the two: then they complete
        here."""
        _, kv = plan.kv_stores.split(plan.early_stores)
        _, mamba = plan.mamba_stores.split(plan.early_stores)
        self._submit_stores(kv, mamba, plan.epoch)
        assert self.copies is not None
        if (
            self.runner_order is RunnerOrder.BLOCKS_FIRST
            and not self.copies.engine.overlaps_compute
        ):
            self.fence()

    def _submit_stores(self, kv_stores: StoreBatch, mamba_stores: StoreBatch, epoch: str) -> None:
        assert self.kv_pool is not None and self.mamba is not None and self.copies is not None
        if self.copies.stores_into(ObjectKind.KV, kv_stores.slots) or self.copies.stores_into(
            ObjectKind.MAMBA, mamba_stores.slots
        ):
            # A slot an earlier store (still copying, on a GPU) fills: that store's bytes go to
            # storage under its own key before this one overwrites them.
            self.settle()
        plans = []
        if kv_stores:
            per_layer = self._kv_per_layer(kv_stores.blocks)
            plans.append(
                plan_copies(self.kv_layers, per_layer, self.kv_pool, kv_stores.slots, True)
            )
        if mamba_stores:
            plans.append(self.mamba.plan_snapshot(mamba_stores.blocks, mamba_stores.slots))
        batches = tuple(
            StoredBatch(kind, tuple(batch.slots), tuple(batch.hashes), tuple(batch.lora_tags))
            for kind, batch in ((ObjectKind.KV, kv_stores), (ObjectKind.MAMBA, mamba_stores))
            if batch
        )
        self.copies.submit_store(plans, StoreDone(batches, epoch))

    def take_results(self) -> tuple[set[str], set[str]]:
        if self.copies is not None:
            self._stores_done(self.copies.reap_stores())  # write-through starts once copied
            self.copies.reap_calls()
            done, failed = self.copies.reap_loads(wait=not self.copies.engine.overlaps_compute)
            self._finished |= done
            self._failed |= failed
        if self.storage is not None:
            if self._engine_idle and self.storage.outstanding():
                self.storage.wait_for_fetch(IDLE_FETCH_WAIT_S)
            elif self._idle_step and self.storage.outstanding():
                time.sleep(IDLE_YIELD_S)
            self.storage.poll()
        finished, failed = self._finished, self._failed
        self._finished, self._failed = set(), set()
        return finished, failed

    # -- helpers -----------------------------------------------------------------
    def _kv_per_layer(self, group_blocks: list[list[int]]) -> list[list[int]]:
        per_layer: list[list[int]] = []
        for blocks, group in zip(group_blocks, self.layout.attention, strict=True):
            per_layer.extend([blocks] * len(group.layer_names))
        return per_layer

    def _check_blocks(self, blocks: list[int], expected: int) -> None:
        if len(blocks) != expected:
            raise ValueError(f"{len(blocks)} destination blocks for {expected} slots")
        if any(b == NULL_BLOCK or not 0 < b < self.layout.num_gpu_blocks for b in blocks):
            raise ValueError(f"invalid destination block in {blocks}")

    @staticmethod
    def _check_slots(slots: list[int], capacity: int) -> None:
        if any(not 0 <= s < capacity for s in slots):
            raise ValueError(f"slot out of range in {slots} (capacity {capacity})")

    def leak_report(self) -> dict[str, int]:
        report = {
            "unreported_loads": len(self._finished),
            "unsent_acks": len(self._orphan_acks),
        }
        if self.copies is not None:
            report.update(self.copies.in_flight())
        if self.storage is not None:
            report.update(self.storage.leak_report())
        return report

    def all_counters(self) -> dict[str, float]:
        out = self.counters.as_dict()
        if self.storage is not None:
            out.update(self.storage.counters.as_dict())
        return out

    def shutdown(self) -> None:
        if self.copies is not None:
            self.settle()
            self.copies.close()
        if self.storage is not None:
            self.storage.close()
            self.storage = None


__all__ = ["WorkerHalf", "StoreBatch"]


def _pool(layer_bytes: list[int], num_slots: int, pin: bool) -> HostSlotPool:
    """Slots with room for a storage header and spares, so fetches read in place (cpu_pool)."""
    return HostSlotPool(layer_bytes, num_slots, pin, HEADER_SIZE, spare_slots(num_slots))
