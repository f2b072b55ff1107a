"""Helpers for the run-time storage control tests: vLLM's real scheduler and both connector
roles in one process (``lifecycle.engine``), driven a step at a time, and probes that tell a
call that returned from one that is stuck."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from himamba.connector.protocol import ControlAction
from tests.lifecycle.engine import LifecycleEngine
from tests.lifecycle.vllm_setup import EngineSpec, make_model_config, write_model_dir

# 0.5 MiB CPU tier (as the lifecycle suite): 192 KV slots, 292 Mamba slots.
CPU_CACHE_GB = 0.5 / 1024


def model_config_in(folder: Path) -> Any:
    return make_model_config(write_model_dir(folder), max_model_len=EngineSpec().max_model_len)


def build_engine(model_config: Any, storage: dict[str, Any] | None = None, **fields: Any) -> Any:
    extra: dict[str, Any] = {"cpu_cache_gb": CPU_CACHE_GB}
    if storage is not None:
        extra["storage"] = storage
    spec = dataclasses.replace(EngineSpec(), connector_config=extra, **fields)
    return LifecycleEngine(spec, model_config)


def serve(engine: LifecycleEngine, req_id: str, prompt: list[int], max_tokens: int = 3) -> None:
    engine.add_request(req_id, prompt, max_tokens=max_tokens)
    engine.run_until_idle()


def control(engine: LifecycleEngine, action: ControlAction, storage: Any = None) -> list[dict]:
    """What ``collective_rpc("himamba_control", ...)`` runs: the call on every rank."""
    return [r.connector.control(action, storage) for r in engine.runners]


def step_until(engine: LifecycleEngine, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Idle engine steps until ``done()``; each yields 1 ms, as an idle engine would wait."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not done after {timeout_s} s: {engine.describe_state()}")
        engine.idle_steps(1)
        time.sleep(0.001)


def switched(engine: LifecycleEngine, url: str | None) -> bool:
    """Every rank and the scheduler half use the store at ``url`` (None: none)."""
    planner = engine.connector.scheduler.storage
    if (None if planner is None else planner.cfg.url) != url:
        return False
    statuses = control(engine, ControlAction.STATUS)
    want = "detached" if url is None else "attached"
    return all(s["storage"] == want and s["scheduler"] == want for s in statuses)


def within(fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """Run ``fn`` on a thread: (True, its result) if it returned within ``timeout_s``, else
    (False, None) and it goes on running (the caller releases whatever holds it)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return False, None
    if "error" in box:
        raise box["error"]
    return True, box.get("value")


class Gate:
    """Holds every call of a wrapped function until opened (a slow disk, a hung adapter)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.entered = threading.Event()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            self._open.wait(60)
            return fn(*args, **kwargs)

        return held

    def open(self) -> None:
        self._open.set()


@contextmanager
def engine_of(
    model_config: Any, storage: dict[str, Any] | None = None, **fields: Any
) -> Iterator[Any]:
    engine = build_engine(model_config, storage, **fields)
    try:
        yield engine
    finally:
        engine.close()


def objects_in(folder: Path) -> int:
    """KV and Mamba objects in ``folder`` (not the health probes each open store writes)."""
    return sum(
        1
        for p in folder.rglob("*.data")
        if p.is_file() and p.name.split("@")[2:3] in (["0"], ["1"])
    )


def switch_storage(engine: LifecycleEngine, action: ControlAction, storage: Any = None) -> None:
    """What ``collective_rpc("himamba_control")`` does, then idle steps (1 ms apart, as an idle
    engine waits) until every rank and the scheduler half use the new store."""
    for runner in engine.runners:
        runner.connector.control(action, storage)
    want = "detached" if action is ControlAction.DETACH else "attached"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        engine.idle_steps(1)
        statuses = [r.connector.control(ControlAction.STATUS) for r in engine.runners]
        if all(s["storage"] == want and s["scheduler"] == want for s in statuses):
            return
        time.sleep(0.001)
    raise AssertionError(f"storage never switched: {statuses}")
