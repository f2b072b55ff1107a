"""The fault hook is loud: a scenario whose fault cannot be applied never runs without it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness.process_faults import ENV, delay_acks, env_for
from tests.harness.subprocess_run import child_env, run_script

CHILD = ["-c", "print('RESULT {}')"]


def test_a_process_with_a_fault_that_cannot_apply_stops_before_running():
    env = child_env(faults=delay_acks(rank=1, steps=3))
    env[ENV] = json.dumps({"delay_acks": {"rank": 1}})  # a spec the patch cannot take
    proc = subprocess.run([sys.executable, *CHILD], env=env, capture_output=True, text=True)
    assert proc.returncode == 70 and "RESULT" not in proc.stdout
    assert "could not apply HIMAMBA_TEST_FAULTS" in proc.stderr


def test_a_process_with_applicable_faults_runs():
    env = child_env(faults=delay_acks(rank=1, steps=3))
    assert run_script(CHILD, env, 120, "child with a fault") == {}


def test_an_unknown_fault_is_refused_by_name():
    with pytest.raises(ValueError, match="drop_everything"):
        env_for({"drop_everything": {}})
