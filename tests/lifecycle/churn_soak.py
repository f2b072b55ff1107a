"""One churn-soak variant end to end: build the engine with a CPU tier of a few dozen slots,
soak it with every fault and ``churn.Churn``'s control, let it settle, audit storage, report.

Split from ``churn`` (the control actions themselves) so each module holds one thing; the
assertions are the callers' (``test_soak``, ``test_device_ordering``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .churn import Churn, ChurnPlan, ChurnStats
from .engine import LifecycleEngine
from .plan_audit import PlanAudit
from .storage_audit import StorageAudit, audit_storage


def host_capacities(engine: LifecycleEngine) -> tuple[int, int]:
    stats = engine.connector.stats()
    return int(stats["host_kv_capacity"]), int(stats["host_mamba_capacity"])


def cpu_cache_for_slots(
    kv_slots: int, mamba_slots: int, kv_slot_bytes: int, mamba_slot_bytes: int
) -> tuple[float, float]:
    """(cpu_cache_gb, mamba_cache_fraction) whose ``HybridLayout.slot_counts`` gives exactly
    these logical slot counts (spares included in the budget, as ``cpu_pool.split_slots``)."""
    from himamba.tiers.cpu_pool import spare_slots

    kv_total = kv_slots + spare_slots(kv_slots)
    mamba_total = mamba_slots + spare_slots(mamba_slots)
    # Half a slot of slack on each side keeps float rounding of the GiB figure harmless.
    mamba_bytes = mamba_total * mamba_slot_bytes + mamba_slot_bytes // 2
    cpu_bytes = kv_total * kv_slot_bytes + kv_slot_bytes // 2 + mamba_bytes
    return cpu_bytes / (1 << 30), mamba_bytes / cpu_bytes


# -- one soak variant, end to end -------------------------------------------------------------

# A CPU tier of a few dozen KV slots and a handful of Mamba slots: nearly every step evicts,
# fetches race evictions, and Mamba slots are contended by loads, stores and fetches at once.
CHURN_KV_SLOTS = 48
CHURN_MAMBA_SLOTS = 6
# Objects of the stand-in model (vllm_setup.EngineSpec): 2 attention layers x 1 KiB, 2 Mamba
# layers x 224 B (checked against the connector's layout in run_churn_soak).
KV_SLOT_BYTES = 2048
MAMBA_SLOT_BYTES = 448
STORE_DIRS = ("store-a", "store-b", "store-c")


@dataclass(frozen=True)
class ChurnVariant:
    write_policy: str
    async_scheduling: bool = False
    # vLLM's Model Runner V2 call order (a GPU engine's default; see runner.StandInRunner).
    model_runner_v2: bool = False
    v2_step_hook: bool = True  # with V2: himamba's step-start hook (False: its fallback)
    kv_slots: int = CHURN_KV_SLOTS
    mamba_slots: int = CHURN_MAMBA_SLOTS
    # Fewer requests in flight than the plain soak's 96: with 6 Mamba slots, 96 requests
    # competing leave almost no fetch room (a few loads per thousand requests); 32 still
    # keep every slot contended and give ~25 loads per thousand.
    live_requests: int = 32
    # vLLM's own cache smaller than the plain soak's (320): with 320 device blocks the GPU
    # holds everything the 48-slot tier does and host hits (what selective write-through
    # counts) never happen; 96 also preempts now and then.
    num_gpu_blocks: int = 96
    # `partial_tail_hits`: finished requests' last partial blocks and states are kept, and the
    # workload's conversation turns (a finished request's prompt and answer plus a new message)
    # hit through them, inside a block.
    partial_tails: bool = False
    conversation_share: float = 0.0

    @property
    def name(self) -> str:
        tags = (
            ("+async" if self.async_scheduling else "")
            + ("+v2" if self.model_runner_v2 else "")
            + ("-nohook" if self.model_runner_v2 and not self.v2_step_hook else "")
            + ("+tails" if self.partial_tails else "")
        )
        return self.write_policy + tags


@dataclass
class ChurnReport:
    variant: str
    num_requests: int
    seed: int
    result: Any = None  # soak.SoakResult
    churn: ChurnStats | None = None
    plans: PlanAudit | None = None
    storage: StorageAudit | None = None
    capacities: tuple[int, int] = (0, 0)
    hits: Any = None
    faults: dict[str, Any] = field(default_factory=dict)
    rows_checked: int = 0
    states_checked: int = 0
    requests_checked: int = 0  # requests whose computed prefix the runner's CHECK read
    from_cache_unchecked: int = 0  # started from a cached prefix, never checked (must be 0)
    seconds: float = 0.0  # the soak itself (build, requests, drain), without the audit
    audit_seconds: float = 0.0
    leaks: list[str] = field(default_factory=list)

    def tails(self) -> dict[str, int]:
        """Next turns sent and the connector's partial-tail counters."""
        stats = self.result.connector_stats if self.result else {}
        out = {"next_turns": self.result.next_turns if self.result else 0}
        for name in (
            "tails_stored",
            "tails_unnamed",
            "tails_overwritten",
            "tail_hits",
            "storage_tails_seen",
        ):
            out[name] = int(stats.get(name, 0))
        return out

    def line(self) -> str:
        r = self.result
        rate = r.requests / r.seconds if r and r.seconds else 0.0
        return (
            f"{self.variant}: {self.num_requests} requests (seed {self.seed}) in {self.seconds:.1f}s "
            f"({rate:.0f} req/s, audit {self.audit_seconds:.1f}s), steps {r.steps if r else '?'}, "
            f"finished {r.finished if r else '?'} aborted {r.aborted if r else '?'} "
            f"errors {r.errors if r else '?'}; slots {self.capacities}; hits {self.hits}; "
            f"actions {dict(self.churn.actions) if self.churn else {}}, resets "
            f"{dict(self.churn.resets) if self.churn else {}}, weight updates "
            f"{self.churn.weight_updates if self.churn else 0}; tails {self.tails()}; plans "
            f"{self.plans.summary() if self.plans else {}}; storage "
            f"{self.storage.summary() if self.storage else {}}; faults {self.faults}; "
            f"checked rows {self.rows_checked} states {self.states_checked} requests "
            f"{self.requests_checked} (from cache, unchecked: {self.from_cache_unchecked}); "
            f"leaks {self.leaks}"
        )


def churn_connector_config(
    store_url: str,
    write_policy: str,
    kv_slots: int = CHURN_KV_SLOTS,
    mamba_slots: int = CHURN_MAMBA_SLOTS,
    partial_tails: bool = False,
) -> dict[str, Any]:
    gb, fraction = cpu_cache_for_slots(kv_slots, mamba_slots, KV_SLOT_BYTES, MAMBA_SLOT_BYTES)
    config: dict[str, Any] = {
        "cpu_cache_gb": gb,
        "mamba_cache_fraction": fraction,
        "storage": {"url": store_url, **churn_storage_section(write_policy)},
    }
    if partial_tails:
        config["partial_tail_hits"] = True
    return config


def churn_storage_section(write_policy: str) -> dict[str, Any]:
    section: dict[str, Any] = {
        "write_policy": write_policy,
        "prefetch_timeout_base_s": 0.1,
        "op_deadline_s": 0.5,
        "breaker_cooldown_s": 0.2,
    }
    if write_policy == "write_through_selective":
        # A host object of a 48-slot tier rarely lives to see the default 2 matches: with
        # them storage stays nearly empty and the selective write path idle.
        section["write_threshold"] = 1
    return section


def run_churn_soak(
    build_engine: Any,
    store_root: Path,
    variant: ChurnVariant,
    num_requests: int,
    seed: int = 0,
    report: ChurnReport | None = None,
    audit: bool = True,
    faults: bool = True,
) -> ChurnReport:
    """Build an engine (``build_engine(**EngineSpec fields)``), soak it with every fault and
    the storage churn, let it settle idle (``report.leaks``: what it still holds), close it and
    audit every stored object (also after a failure). Fills ``report`` as it goes, so a caller
    that catches a failure still sees how far it got; assertions are the caller's.
    ``faults=False`` turns every injected fault off (to tell which failures need them)."""
    from .faults import LoadFaults, StorageFaults, failing_loads, faulty_storage
    from .leaks import settled_leaks
    from .soak import SoakPlan, ack_faults, run_soak

    report = report or ChurnReport(variant.name, num_requests, seed)
    dirs = [store_root / d for d in STORE_DIRS]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    on = 1.0 if faults else 0.0
    with (
        faulty_storage(
            StorageFaults(
                fail_rate_lookup=0.01 * on,
                fail_rate_load=0.02 * on,
                fail_rate_store=0.01 * on,
                seed=seed,
            )
        ) as storage_faults,
        failing_loads(LoadFaults(fail_rate=0.01 * on, seed=seed + 1)) as load_faults,
    ):
        engine = build_engine(
            describe=False,
            num_gpu_blocks=variant.num_gpu_blocks,
            max_num_seqs=128,
            max_num_batched_tokens=2048,
            max_model_len=512,
            async_scheduling=variant.async_scheduling,
            model_runner_v2=variant.model_runner_v2,
            v2_step_hook=variant.v2_step_hook,
            connector_config=churn_connector_config(
                f"file://{dirs[0]}",
                variant.write_policy,
                variant.kv_slots,
                variant.mamba_slots,
                variant.partial_tails,
            ),
        )
        layout = engine.connector.layout
        assert (layout.kv_slot_bytes, layout.mamba_slot_bytes) == (KV_SLOT_BYTES, MAMBA_SLOT_BYTES)
        report.capacities = host_capacities(engine)
        late, lost = ack_faults(seed=seed + 2, keep_control=True)
        if faults:
            engine.output_faults.extend((late, lost))
        churn = Churn(
            engine,
            ChurnPlan(seed=seed, storage=churn_storage_section(variant.write_policy)),
            dirs,
        )
        report.churn, report.plans = churn.stats, churn.plans
        try:
            report.result = run_soak(
                engine,
                SoakPlan(
                    num_requests=num_requests,
                    seed=seed,
                    live_requests=variant.live_requests,
                    salted_share=0.05,
                    abort_rate=0.02 * on,
                    conversation_share=variant.conversation_share,
                ),
                lost_acks=lost if faults else None,
                churn=churn,
            )
            report.seconds = time.monotonic() - start
            churn.settle_storage()
            report.leaks = settled_leaks(engine)
        finally:
            report.hits = engine.hits
            report.faults = {
                "storage": dict(storage_faults.counts),
                "failed_loads": load_faults.failed,
                "late_acks": late.delayed,
                "lost_acks": lost.dropped,
            }
            report.rows_checked = sum(r.counters.rows_checked for r in engine.runners)
            report.states_checked = sum(r.counters.states_checked for r in engine.runners)
            counters = engine.runners[0].counters
            report.requests_checked = len(counters.requests_checked)
            report.from_cache_unchecked = len(
                counters.requests_from_cache - counters.requests_checked
            )
            # Write-back flushes what only the host had at a clean shutdown: audit after it,
            # and audit even after a failure (what storage holds then is evidence too).
            engine.close()
            if audit:
                t0 = time.monotonic()
                report.storage = audit_storage(engine, dirs, churn.oracle, churn.plans)
                report.audit_seconds = time.monotonic() - t0
    return report
