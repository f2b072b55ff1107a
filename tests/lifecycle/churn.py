"""Storage churn for the soak: run-time control between steps, plan auditing, storage audit.

``Churn`` plugs into ``soak.run_soak``: between engine steps it attaches, detaches and
switches storage through the worker connectors' ``control`` entry point (what vLLM's
``collective_rpc`` reaches; the scheduler half follows from the workers' metadata, possibly
some steps later, which nothing here assumes), resets with and without the connector, drops
the host tier, and now and then makes a "weight update" (drain, reset with the connector,
new model epoch: bytes cached before it are stale for every later request).

Two records are kept on the way through, without altering anything the connector returns:
every step plan, checked for host slots given two roles (``plan_audit``), and every request's
block hashes and tokens at finish (``storage_audit.PrefixOracle``), against which
``storage_audit.audit_storage`` reads back every object left in storage after the run.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.v1.request import RequestStatus

from .engine import LifecycleEngine
from .plan_audit import ControlAction, PlanAudit, record_plans
from .storage_audit import PrefixOracle, StorageAudit, audit_storage

ACTIONS = (
    "attach",  # (re)attach the store last attached (or the first one)
    "detach",
    "switch",  # attach another file:// directory
    "reset_connector",  # vLLM's reset_prefix_cache(reset_connector=True), requests running
    "reset_vllm",  # vLLM's own prefix cache only
    "drop_host_tier",
    "weight_update",  # drain, reset with the connector, new model epoch
)


@dataclass(frozen=True)
class ChurnPlan:
    seed: int = 0
    # Steps between control actions, drawn uniformly.
    every_steps: tuple[int, int] = (20, 100)
    # Relative weights of ACTIONS.
    weights: tuple[float, ...] = (3, 3, 3, 2, 2, 2, 0.5)
    # Base storage section (write policy, deadlines); the url is added per directory.
    storage: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChurnStats:
    actions: Counter = field(default_factory=Counter)
    # "connector|vllm[+preempt]:ok|refused" -> count (reset_prefix_cache's answer)
    resets: Counter = field(default_factory=Counter)
    resets_refused: int = 0  # weight updates: refused resets on the idle engine (retried)
    weight_updates: int = 0
    drain_steps: int = 0
    urls_used: list[str] = field(default_factory=list)


class Churn:
    """Random control actions between the soak's steps (see the module docstring)."""

    def __init__(
        self, engine: LifecycleEngine, plan: ChurnPlan, store_dirs: list[Path], initial: int = 0
    ) -> None:
        assert ControlAction is not None, "no ControlAction in this himamba"
        self.engine = engine
        self.plan = plan
        self.rng = random.Random(plan.seed + 7919)
        self.dirs = list(store_dirs)
        self.current: int | None = initial  # index of the directory asked for; None: detached
        self.last = initial
        self.stats = ChurnStats(urls_used=[self.url(initial)])
        self.draining = False
        # Every action once, in a random order, before the weighted draws: a rare one (a
        # weight update) is never left out of a run by chance.
        self._first = list(ACTIONS)
        self.rng.shuffle(self._first)
        self._next_at = self._draw()
        self.plans = PlanAudit()
        record_plans(engine, self.plans)
        self.oracle = PrefixOracle(engine)

    def url(self, i: int) -> str:
        return f"file://{self.dirs[i]}"

    def section(self, i: int) -> dict[str, Any]:
        return {**self.plan.storage, "url": self.url(i)}

    def _draw(self) -> int:
        return self.engine.steps + self.rng.randint(*self.plan.every_steps)

    # -- hooks called by run_soak --------------------------------------------------------
    def may_admit(self) -> bool:
        return not self.draining

    def after_step(self, live: set[str]) -> None:
        engine = self.engine
        if self.draining:
            self.stats.drain_steps += 1
            if not live and not engine.scheduler.has_requests():
                self._finish_weight_update()
            return
        if engine.steps < self._next_at:
            return
        self._next_at = self._draw()
        if self._first:
            action = self._first.pop()
        else:
            action = self.rng.choices(ACTIONS, weights=self.plan.weights)[0]
        self.stats.actions[action] += 1
        getattr(self, "_" + action)()

    # -- the actions ---------------------------------------------------------------------
    def _control(self, action: Any, storage: dict[str, Any] | None = None) -> None:
        """Every rank switches its own store now; the scheduler half follows whenever the
        workers' report reaches it (no step count is assumed)."""
        for runner in self.engine.runners:
            runner.connector.control(action, storage)

    def _attach_dir(self, i: int) -> None:
        self._control(ControlAction.ATTACH, self.section(i))
        self.current = self.last = i
        url = self.url(i)
        if url not in self.stats.urls_used:
            self.stats.urls_used.append(url)

    def _attach(self) -> None:
        self._attach_dir(self.last)

    def _detach(self) -> None:
        self._control(ControlAction.DETACH)
        self.current = None

    def _switch(self) -> None:
        others = [i for i in range(len(self.dirs)) if i != self.last]
        self._attach_dir(self.rng.choice(others))

    def _reset_connector(self) -> None:
        self._reset(connector=True)

    def _reset_vllm(self) -> None:
        self._reset(connector=False)

    def _reset(self, connector: bool) -> None:
        """vLLM's ``reset_prefix_cache`` with requests running. Half the time with
        ``reset_running_requests`` (what RL frameworks call: every running request is preempted
        and its blocks freed, so the reset succeeds), unless a request holds blocks for a
        connector load or a finished one not yet scheduled (vLLM raises then: "not supported
        yet": only running requests are preempted); otherwise it fails while blocks
        are in use, and the connector's part (``connector``) may still have run. Bytes are
        unchanged either way: no new model epoch."""
        scheduler = self.engine.scheduler
        force = not any(map(_holds_blocks_waiting, scheduler.requests.values()))
        force = force and self.rng.random() < 0.5
        self.engine.flush_queue()
        ok = scheduler.reset_prefix_cache(reset_running_requests=force, reset_connector=connector)
        kind = ("connector" if connector else "vllm") + ("+preempt" if force else "")
        self.stats.resets[f"{kind}:{'ok' if ok else 'refused'}"] += 1

    def _drop_host_tier(self) -> None:
        self.engine.connector.drop_host_tier()

    def _weight_update(self) -> None:
        """Stop admitting; once nothing runs, reset everything and move to new weights."""
        self.draining = True

    def _finish_weight_update(self, max_tries: int = 2000) -> None:
        engine = self.engine
        engine.flush_queue()
        for _ in range(max_tries):
            if engine.scheduler.reset_prefix_cache(reset_connector=True):
                break
            self.stats.resets_refused += 1
            engine.idle_steps(1)
        else:
            raise AssertionError(
                f"reset never succeeded on an idle engine: {engine.describe_state()}"
            )
        engine.model.epoch += 1
        self.stats.weight_updates += 1
        self.draining = False

    # -- the end ---------------------------------------------------------------------------
    def settle_storage(self, max_steps: int = 2000) -> None:
        """Idle steps until both halves follow the last switch asked for (however many steps
        a switch takes), then require that they agree on which store is attached, if any."""
        want = None if self.current is None else self.url(self.current)

        def views() -> tuple[str | None, list[bool]]:
            workers = [
                getattr(r.connector.worker, "storage", None) is not None
                for r in self.engine.runners
            ]
            return scheduler_storage_url(self.engine), workers

        seen, workers = views()
        for _ in range(max_steps):
            if seen == want and all(w == (want is not None) for w in workers):
                return
            self.engine.idle_steps(1)
            time.sleep(0.001)
            seen, workers = views()
        raise AssertionError(
            f"storage never settled: asked for {want!r}, the scheduler half follows {seen!r}, "
            f"workers attached {workers}"
        )


def _holds_blocks_waiting(request: Any) -> bool:
    """A request outside ``running`` that holds device blocks: its async load is in flight, or
    it finished and the request waits to be scheduled (vLLM's ``_holds_kv_blocks``)."""
    if request.status == RequestStatus.RUNNING:
        return False
    return request.status == RequestStatus.WAITING_FOR_REMOTE_KVS or request.num_computed_tokens > 0


def scheduler_storage_url(engine: LifecycleEngine) -> str | None:
    planner = engine.connector.scheduler.storage
    return None if planner is None else planner.cfg.url


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
        tags = ("+async" if self.async_scheduling else "") + (
            "+tails" if self.partial_tails else ""
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
        for name in ("tails_stored", "tail_hits", "storage_tails_seen"):
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
