"""Plan audit for the churn soak: every step plan the scheduler connector builds is checked for a
host slot given two roles in one plan (``protocol.plan_conflicts``; a local copy for plan shapes
that predate it), and each plan's storage epoch is noted. Imports are version-tolerant so the
same soak also measures older connector layouts."""

from __future__ import annotations

import importlib
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .engine import LifecycleEngine

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
