"""Run a scenario (``tests/harness/scenarios.py``) or any harness script in a fresh interpreter
and return the JSON of its ``RESULT`` line.

Children run as modules (``python -m tests.harness.scenarios``) with the repository root on
``PYTHONPATH``, so they import the harness the same way the tests and benchmarks do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.harness.process_faults import Faults, env_for

REPO = Path(__file__).resolve().parents[2]
FAULTS_BOOT = Path(__file__).resolve().parent / "faults_boot"


def child_env(env: dict[str, str] | None = None, faults: Faults | None = None) -> dict[str, str]:
    """This process's environment plus ``env``, with the repository root (and, for ``faults``,
    the fault start-up hook) first on ``PYTHONPATH``."""
    out = {**os.environ, **(env or {})}
    paths = [str(REPO)]
    if faults:
        paths.insert(0, str(FAULTS_BOOT))
        out.update(env_for(faults))
    if out.get("PYTHONPATH"):
        paths.append(out["PYTHONPATH"])
    out["PYTHONPATH"] = os.pathsep.join(paths)
    return out


def run_scenario(
    name: str,
    args: dict[str, Any],
    timeout: float = 600,
    faults: Faults | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``faults``: patches applied in every process of the scenario (``process_faults``);
    ``env``: extra environment (e.g. a multi-process engine)."""
    argv = ["-m", "tests.harness.scenarios", name, json.dumps(args)]
    return run_script(argv, child_env(env, faults), timeout, f"scenario {name}")


def run_script(argv: list[str], env: dict[str, str], timeout: float, what: str) -> dict[str, Any]:
    """Run ``python argv...`` and return the JSON of its ``RESULT`` line; fail with the tail of
    its output (naming ``what``) when it printed none."""
    proc = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]).strip()
    raise AssertionError(f"{what} failed (rc={proc.returncode}):\n{tail}")
