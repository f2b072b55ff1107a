"""Test-only fault injection for engines whose workers run in spawned processes.

vLLM's CPU platform starts TP workers with ``spawn``, so a monkeypatch made in the test process
never reaches them. ``tests/engine.py`` puts this folder on ``PYTHONPATH`` and sets
``HIMAMBA_TEST_FAULTS`` (JSON) only for scenarios that ask for a fault; every interpreter of that
scenario (the engine and each worker) then applies the patches below at start-up. Faults are the
kind no real part produces on demand: one rank's fetch acknowledgements arriving steps late, or
a package missing from the environment.
"""

from __future__ import annotations

import json
import os

_FAULTS = json.loads(os.environ.get("HIMAMBA_TEST_FAULTS") or "{}")


def _delay_acks(rank: int, steps: int) -> None:
    """Rank ``rank`` holds each fetch acknowledgement back for ``steps`` engine steps."""
    from himamba.connector import worker_storage

    original = worker_storage.WorkerStorage.take_acks

    def take_acks(self):  # type: ignore[no-untyped-def]
        held = self.__dict__.setdefault("_held_acks", [])
        fresh = original(self)
        if self.rank != rank:
            return fresh
        held.extend([steps, ack] for ack in fresh)
        due = [ack for left, ack in held if left <= 0]
        self.__dict__["_held_acks"] = [[left - 1, ack] for left, ack in held if left > 0]
        worker_storage.DELAYED_ACKS = getattr(worker_storage, "DELAYED_ACKS", 0) + len(fresh)
        return due

    worker_storage.WorkerStorage.take_acks = take_acks  # type: ignore[method-assign]


def _hide_modules(names: list[str]) -> None:
    """Make ``names`` (and their submodules) unimportable, as if never installed: the install
    footprint test runs the CPU tier as a core-only install would."""
    import importlib.abc
    import sys

    class Hidden(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
            if fullname.split(".")[0] in names:
                raise ModuleNotFoundError(f"No module named {fullname!r} (hidden by the test)")
            return None

    sys.meta_path.insert(0, Hidden())


if "delay_acks" in _FAULTS:
    _delay_acks(**_FAULTS["delay_acks"])
if "hide_modules" in _FAULTS:
    _hide_modules(_FAULTS["hide_modules"])
