"""Run a scenario from tests/scenarios.py in a fresh interpreter and return its RESULT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run_scenario(
    name: str,
    args: dict[str, Any],
    timeout: float = 600,
    faults: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``faults``: patches applied in every process of the scenario (tests/faults); ``env``:
    extra environment (e.g. a multi-process engine)."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(HERE)}
    if faults:
        env["PYTHONPATH"] = os.pathsep.join([str(HERE / "faults"), str(HERE)])
        env["HIMAMBA_TEST_FAULTS"] = json.dumps(faults)
    script = [str(HERE / "scenarios.py"), name, json.dumps(args)]
    return run_script(script, env, timeout, f"scenario {name}")


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
