"""Faults injected into every process of a scenario, including vLLM's spawned TP workers.

vLLM's CPU platform starts TP workers with ``spawn``, so a monkeypatch made in the test process
never reaches them. A test asks for a fault by calling one of the functions below and passing
the result to ``run_scenario(..., faults=...)``; ``subprocess_run`` then puts
``faults_boot/`` on ``PYTHONPATH`` and the spec in ``HIMAMBA_TEST_FAULTS``, and that folder's
``sitecustomize`` calls ``apply_from_env`` in every interpreter of the scenario (the engine and
each worker). A fault whose target cannot be patched stops the process at start-up: a silently
missing fault would let its test pass for the wrong reason. Faults are the kind no real part
produces on demand.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

ENV = "HIMAMBA_TEST_FAULTS"
Faults = dict[str, dict[str, Any]]


def delay_acks(rank: int, steps: int) -> Faults:
    """Rank ``rank`` reports each fetch acknowledgement ``steps`` engine steps late."""
    return {"delay_acks": {"rank": rank, "steps": steps}}


def hide_modules(names: list[str]) -> Faults:
    """``names`` (and their submodules) are unimportable, as if never installed."""
    return {"hide_modules": {"names": list(names)}}


def _after_import(module_name: str, patch: Callable[[ModuleType], None]) -> None:
    """Run ``patch(module)`` right after ``module_name`` is first imported. Importing it here,
    at interpreter start, would load torch before vLLM configures its threads (a CPU engine
    then runs ~10x slower); its spec is found now, so a wrong name still fails at start."""
    if module_name in sys.modules:
        patch(sys.modules[module_name])
        return
    if importlib.util.find_spec(module_name) is None:
        raise ModuleNotFoundError(f"fault target {module_name!r} does not exist")

    class PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname != module_name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            assert spec is not None and spec.loader is not None
            run = spec.loader.exec_module

            def exec_and_patch(module: ModuleType) -> None:
                run(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, PatchOnImport())


def _apply_delay_acks(rank: int, steps: int) -> None:
    def patch(worker_storage: ModuleType) -> None:
        original = worker_storage.WorkerStorage.take_acks

        def take_acks(self: Any) -> list[Any]:
            held = self.__dict__.setdefault("_held_acks", [])
            fresh = original(self)
            if self.rank != rank:
                return fresh
            held.extend([steps, ack] for ack in fresh)
            due = [ack for left, ack in held if left <= 0]
            self.__dict__["_held_acks"] = [[left - 1, ack] for left, ack in held if left > 0]
            return due

        worker_storage.WorkerStorage.take_acks = take_acks

    _after_import("himamba.connector.worker.worker_storage", patch)


def _apply_hide_modules(names: list[str]) -> None:
    class Hidden(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
            if fullname.split(".")[0] in names:
                raise ModuleNotFoundError(f"No module named {fullname!r} (hidden by the test)")
            return None

    sys.meta_path.insert(0, Hidden())


_APPLY: dict[str, Callable[..., None]] = {
    "delay_acks": _apply_delay_acks,
    "hide_modules": _apply_hide_modules,
}


def env_for(faults: Faults) -> dict[str, str]:
    """The environment entry that carries ``faults`` to every process of a scenario."""
    unknown = set(faults) - set(_APPLY)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; known: {sorted(_APPLY)}")
    return {ENV: json.dumps(faults)}


def apply_from_env() -> None:
    """Apply the faults named in ``HIMAMBA_TEST_FAULTS`` (called by ``faults_boot``)."""
    for name, kwargs in json.loads(os.environ.get(ENV) or "{}").items():
        _APPLY[name](**kwargs)
