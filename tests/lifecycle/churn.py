"""Storage churn for the soak: run-time control between steps, plan auditing, storage audit.

``Churn`` plugs into ``soak.run_soak``: between engine steps it attaches, detaches and
switches storage through the worker connectors' ``control`` entry point (what vLLM's
``collective_rpc`` reaches; the scheduler half follows from the workers' metadata, possibly
some steps later, which nothing here assumes), resets with and without the connector, drops
the host tier, and now and then makes a "weight update" (drain, reset with the connector,
new model epoch: bytes cached before it are stale for every later request).

Two records are kept on the way through, without altering anything the connector returns:

* every step plan the scheduler connector builds, checked for host slots given two roles in one
  plan (``protocol.plan_conflicts``; a local copy for plan shapes that predate it);
* every request's block hashes and tokens at finish (``PrefixOracle``), so that after the run
  ``audit_storage`` can read every object left in every store directory and compare its bytes
  with what the stand-in runner computes for that prefix: a wrong object in storage is as bad
  as a wrong hit, only later.
"""

from __future__ import annotations

import importlib
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.request import RequestStatus

from .engine import LifecycleEngine
from .prefix_bytes import TokenChain, salt_seed

# -- version-tolerant imports (the suite also runs against older connector layouts) ---------


def _first_attr(modules: tuple[str, ...], attr: str) -> Any:
    """``attr`` of the first of ``modules`` that belongs to the himamba under test. An editable
    install's import hook can resolve a submodule missing from an older tree (one put first
    on sys.path) to the installed tree's file: such a module is not used."""
    import himamba.connector

    home = os.path.realpath(os.path.dirname(himamba.connector.__file__))
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if not os.path.realpath(module.__file__ or "").startswith(home + os.sep):
            continue
        if hasattr(module, attr):
            return getattr(module, attr)
    return None


ControlAction = _first_attr(
    ("himamba.connector.protocol", "himamba.connector.control"), "ControlAction"
)
_plan_conflicts = _first_attr(("himamba.connector.protocol",), "plan_conflicts")

KV_KIND, MAMBA_KIND = 0, 1
ROLE_NAMES = ("STORE_TARGET", "FETCH_TARGET", "WRITE_SOURCE", "LOAD_SOURCE")
_TARGET_ROLES = ("STORE_TARGET", "FETCH_TARGET")


def _slot_roles(plan: Any) -> list[tuple[int, int, str]]:
    """(kind, slot, role) of every host slot a plan touches, for both plan shapes: loads'
    ``kv_slots``/``mamba_slot``, stores' ``slots``, fetch items' ``slot``/``kind`` and
    storage writes as ``StorageWrite`` records or ``(kind, slot, hash)`` tuples."""
    out = [(KV_KIND, int(s), "STORE_TARGET") for s in plan.kv_stores.slots]
    out += [(MAMBA_KIND, int(s), "STORE_TARGET") for s in plan.mamba_stores.slots]
    for order in plan.fetches:
        out += [(int(it.kind), int(it.slot), "FETCH_TARGET") for it in order.items]
    for w in plan.storage_writes:
        kind, slot = (w.kind, w.slot) if hasattr(w, "slot") else (w[0], w[1])
        out.append((int(kind), int(slot), "WRITE_SOURCE"))
    for job in plan.loads:
        if getattr(job, "doomed", None):
            continue  # the worker copies nothing for it
        out += [(KV_KIND, int(s), "LOAD_SOURCE") for s in job.kv_slots]
        out.append((MAMBA_KIND, int(job.mamba_slot), "LOAD_SOURCE"))
    return out


def local_plan_conflicts(plan: Any) -> list[tuple[int, int, tuple[str, ...]]]:
    """``protocol.plan_conflicts`` for any plan shape: a slot written (store or fetch target)
    that has another role, or the same target role twice, in one plan."""
    roles: dict[tuple[int, int], list[str]] = {}
    for kind, slot, role in _slot_roles(plan):
        roles.setdefault((kind, slot), []).append(role)
    return [
        (kind, slot, tuple(rs))
        for (kind, slot), rs in roles.items()
        if len(rs) > 1 and any(r in _TARGET_ROLES for r in rs)
    ]


def plan_conflicts(plan: Any) -> list[tuple[int, int, tuple[str, ...]]]:
    """The connector's own validator where it exists, normalised to ints and role names."""
    if _plan_conflicts is None:
        return local_plan_conflicts(plan)
    return [
        (int(kind), int(slot), tuple(getattr(r, "name", str(r)) for r in roles))
        for kind, slot, roles in _plan_conflicts(plan)
    ]


def _plan_epoch(plan: Any) -> str:
    gen = getattr(plan, "generation", None)
    return str(getattr(gen, "epoch", None) if gen is not None else getattr(plan, "epoch", ""))


def _order_epoch(order: Any) -> str:
    gen = getattr(order, "generation", None)
    return str(gen.epoch if gen is not None else getattr(order, "epoch", ""))


# -- records kept on the way through --------------------------------------------------------


@dataclass
class PlanAudit:
    plans: int = 0
    plans_with_conflicts: int = 0
    conflict_entries: int = 0
    # Distinct (kind, slot, roles) seen over the run, and how often each role mix occurred.
    distinct: set[tuple[int, int, tuple[str, ...]]] = field(default_factory=set)
    by_roles: Counter = field(default_factory=Counter)
    first: list[str] = field(default_factory=list)
    # Storage key epoch -> model epochs that were current when a plan used it.
    epochs: dict[str, set[int]] = field(default_factory=dict)

    @property
    def distinct_conflicts(self) -> int:
        return len(self.distinct)

    def summary(self) -> dict[str, Any]:
        return {
            "plans": self.plans,
            "plans_with_conflicts": self.plans_with_conflicts,
            "conflict_entries": self.conflict_entries,
            "distinct_conflicts": self.distinct_conflicts,
            "by_roles": {"+".join(k): v for k, v in self.by_roles.items()},
            "first": self.first[:5],
        }


def record_plans(engine: LifecycleEngine, audit: PlanAudit) -> None:
    """Wrap the scheduler connector's ``build_connector_meta``: every plan it returns is
    checked for slot-role conflicts and its storage epoch noted (the plan is not altered)."""
    conn = engine.connector
    real = conn.build_connector_meta

    def recorded(scheduler_output: Any) -> Any:
        meta = real(scheduler_output)
        plan = getattr(meta, "plan", None)
        if plan is not None:
            audit.plans += 1
            model_epoch = engine.model.epoch
            epochs = {_plan_epoch(plan)} | {_order_epoch(o) for o in plan.fetches}
            for e in epochs:
                audit.epochs.setdefault(e, set()).add(model_epoch)
            conflicts = plan_conflicts(plan)
            if conflicts:
                audit.plans_with_conflicts += 1
                audit.conflict_entries += len(conflicts)
                for c in conflicts:
                    audit.distinct.add(c)
                    audit.by_roles[c[2]] += 1
                if len(audit.first) < 5:
                    audit.first.append(
                        f"step {engine.steps + 1}: "
                        + ", ".join(
                            f"{'KV' if k == KV_KIND else 'MAMBA'} slot {s}: {'+'.join(r)}"
                            for k, s, r in conflicts[:4]
                        )
                    )
        return meta

    conn.build_connector_meta = recorded


@dataclass
class _Prefix:
    tokens: np.ndarray  # uint32, the request's tokens (shared by all its blocks)
    index: int  # block index: the hash names tokens[: (index + 1) * block_size]
    salt: str | None


class PrefixOracle:
    """vLLM block hash -> the tokens (and cache salt) it names, recorded from each request as
    the scheduler finishes it (``request_finished_all_groups`` sees its final block hashes)."""

    def __init__(self, engine: LifecycleEngine) -> None:
        self.block_size = engine.kv.block_size
        self.hashes: dict[bytes, _Prefix] = {}
        self.requests = 0
        conn = engine.connector
        real = conn.request_finished_all_groups

        def recorded(request: Any, block_ids: Any) -> Any:
            self.note(request)
            return real(request, block_ids)

        conn.request_finished_all_groups = recorded

    def note(self, request: Any) -> None:
        self.requests += 1
        tokens: np.ndarray | None = None
        for i, h in enumerate(request.block_hashes):
            h = bytes(h)
            if h in self.hashes:
                continue
            if tokens is None:
                tokens = np.asarray(list(request.all_token_ids), dtype=np.uint32)
            self.hashes[h] = _Prefix(tokens, i, request.cache_salt)

    def chain(self, block_hash: bytes, model_epoch: int) -> tuple[TokenChain, int] | None:
        """The digest chain of the prefix ``block_hash`` names, and that prefix's length."""
        p = self.hashes.get(block_hash)
        if p is None:
            return None
        n = (p.index + 1) * self.block_size
        chain = TokenChain(self.block_size, salt_seed(p.salt, model_epoch))
        chain.append([int(t) for t in p.tokens[:n]])
        return chain, n


# -- run-time control ---------------------------------------------------------------------

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


# -- the storage audit ----------------------------------------------------------------------


@dataclass
class StorageAudit:
    objects: int = 0
    checked: int = 0
    by_kind: Counter = field(default_factory=Counter)
    invalid: Counter = field(default_factory=Counter)  # validate_object's reason
    unknown_epoch: int = 0  # salt tag of no epoch any plan used
    unknown_hash: int = 0  # a block hash no finished request had
    ambiguous_epoch: int = 0  # an epoch used under more than one model epoch
    wrong: list[str] = field(default_factory=list)  # valid objects with the wrong bytes
    by_dir: dict[str, int] = field(default_factory=dict)

    def problems(self) -> list[str]:
        out = list(self.wrong[:10])
        if len(self.wrong) > 10:
            out.append(f"... {len(self.wrong) - 10} more wrong objects")
        if self.invalid:
            out.append(f"invalid objects: {dict(self.invalid)}")
        for name in ("unknown_epoch", "unknown_hash", "ambiguous_epoch"):
            if getattr(self, name):
                out.append(f"{name}: {getattr(self, name)}")
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "objects": self.objects,
            "checked": self.checked,
            "by_kind": dict(self.by_kind),
            "wrong": len(self.wrong),
            "invalid": dict(self.invalid),
            "unknown_epoch": self.unknown_epoch,
            "unknown_hash": self.unknown_hash,
            "ambiguous_epoch": self.ambiguous_epoch,
            "by_dir": self.by_dir,
        }


def _layer_indices(engine: LifecycleEngine) -> dict[str, int]:
    runner = engine.runners[0]
    return {
        layer.name: layer.index for layers in runner.layers_by_group.values() for layer in layers
    }


def expected_payload(
    engine: LifecycleEngine, chain: TokenChain, n: int, kind: int, rank: int
) -> np.ndarray:
    """The bytes the stand-in runner computes for the object of kind ``kind`` that names the
    prefix of ``n`` tokens: per layer (layout order) the block's attention rows, or the Mamba
    state after exactly ``n`` tokens."""
    layout = engine.connector.layout
    model, bs = engine.model, engine.kv.block_size
    index = _layer_indices(engine)
    parts = []
    groups = layout.attention if kind == KV_KIND else layout.mamba
    for g in groups:
        for name in g.layer_names:
            if kind == KV_KIND:
                part = model.attention_rows(chain, n - bs, n, index[name], rank).reshape(-1)
            else:
                part = model.mamba_state(chain, n, index[name], rank)
            assert part.size == g.layer_block_bytes, (name, part.size, g.layer_block_bytes)
            parts.append(part)
    return np.concatenate(parts)


def _describe_found(engine: LifecycleEngine, payload: np.ndarray, kind: int) -> str:
    """The first attention row (or the first layer's Mamba state) of a stored payload."""
    layout = engine.connector.layout
    first = (layout.attention if kind == KV_KIND else layout.mamba)[0].layer_block_bytes
    head = payload[: engine.model.attn_row_bytes] if kind == KV_KIND else payload[:first]
    return engine.model.describe(head, state=kind != KV_KIND)


def audit_storage(
    engine: LifecycleEngine, dirs: list[Path], oracle: PrefixOracle, plans: PlanAudit
) -> StorageAudit:
    """Read every object in every store directory; each must validate under its own key and
    hold exactly the bytes of the prefix its block hash names (in the model epoch of its
    storage epoch)."""
    from himamba.connector.storage_setup import storage_config, storage_namespace
    from himamba.tiers.object_format import (
        HEADER_SIZE,
        ObjectKind,
        StorageKey,
        key_digest,
        resolve_algo,
        salt_tag,
        validate_object,
    )

    audit = StorageAudit()
    layout = engine.connector.layout
    world = engine.spec.tensor_parallel_size
    scfg = storage_config({"url": f"file://{dirs[0]}"})
    namespaces = [storage_namespace(engine.vllm_config, layout, r, scfg) for r in range(world)]
    tags = {ns.model_tag(): r for r, ns in enumerate(namespaces)}
    algo = resolve_algo(scfg.checksum)
    by_tag = {salt_tag(e): e for e in plans.epochs}
    payload_bytes = {KV_KIND: layout.kv_slot_bytes, MAMBA_KIND: layout.mamba_slot_bytes}
    chains: dict[tuple[bytes, int], tuple[TokenChain, int] | None] = {}
    for d in dirs:
        count = 0
        for path in sorted(Path(d).rglob("*.data")):
            parts = path.name[: -len(".data")].split("@")
            if len(parts) < 4 or parts[0] not in tags:
                continue
            kind = int(parts[2], 16)
            if kind not in payload_bytes:
                continue  # breaker health probes
            count += 1
            audit.objects += 1
            audit.by_kind["kv" if kind == KV_KIND else "mamba"] += 1
            rank = tags[parts[0]]
            block_hash = bytes.fromhex(parts[3])
            epoch = by_tag.get(parts[4] if len(parts) > 4 else "")
            if epoch is None:
                audit.unknown_epoch += 1
                continue
            model_epochs = plans.epochs[epoch]
            if len(model_epochs) != 1:
                audit.ambiguous_epoch += 1
            data = path.read_bytes()
            ns = namespaces[rank]
            reason = validate_object(
                memoryview(data),
                kind=ObjectKind(kind),
                payload_nbytes=payload_bytes[kind],
                layout_digest=ns.digest(),
                key_dig=key_digest(ns, StorageKey(block_hash, ObjectKind(kind), epoch)),
                algo=algo,
            )
            if reason is not None:
                audit.invalid[reason] += 1
                continue
            if block_hash not in oracle.hashes:
                audit.unknown_hash += 1
                continue
            payload = np.frombuffer(data, dtype=np.uint8, offset=HEADER_SIZE)
            audit.checked += 1
            n = 0
            for model_epoch in sorted(model_epochs):
                key = (block_hash, model_epoch)
                if key not in chains:
                    chains[key] = oracle.chain(block_hash, model_epoch)
                found = chains[key]
                assert found is not None
                chain, n = found
                if np.array_equal(payload, expected_payload(engine, chain, n, kind, rank)):
                    break
            else:
                what = "KV block" if kind == KV_KIND else "Mamba state"
                stale = [
                    m
                    for m in range(engine.model.epoch + 1)
                    if m not in model_epochs
                    and np.array_equal(
                        payload,
                        expected_payload(engine, *oracle.chain(block_hash, m), kind, rank),
                    )
                ]
                whose = (
                    f"this prefix's bytes of model epoch {stale[0]} (stale)"
                    if stale
                    else "bytes of another prefix"
                )
                audit.wrong.append(
                    f"{Path(d).name}: {what} {block_hash.hex()[:16]} (epoch {epoch!r}, model "
                    f"epochs {sorted(model_epochs)}, prefix of {n} tokens, rank {rank}) holds "
                    f"{whose} [{_describe_found(engine, payload, kind)}]"
                )
        audit.by_dir[Path(d).name] = count
    return audit


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

    @property
    def name(self) -> str:
        return self.write_policy + ("+async" if self.async_scheduling else "")


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
            f"{self.churn.weight_updates if self.churn else 0}; plans "
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
) -> dict[str, Any]:
    gb, fraction = cpu_cache_for_slots(kv_slots, mamba_slots, KV_SLOT_BYTES, MAMBA_SLOT_BYTES)
    return {
        "cpu_cache_gb": gb,
        "mamba_cache_fraction": fraction,
        "storage": {"url": store_url, **churn_storage_section(write_policy)},
    }


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
                f"file://{dirs[0]}", variant.write_policy, variant.kv_slots, variant.mamba_slots
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
