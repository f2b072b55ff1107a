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
from .storage_audit import PrefixOracle

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
