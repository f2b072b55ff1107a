"""The README's main job (`make demo`) keeps working: cold run, device hit, CPU-tier hit and a
storage hit on the tiny hybrid, with identical tokens every time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness.subprocess_run import REPO

pytestmark = pytest.mark.e2e


def test_the_offline_demo_serves_every_tier_with_identical_tokens():
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "offline_demo.py"), "--prompt-tokens", "600"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-4000:]
    assert "from=himamba CPU tier" in out and "from=storage -> CPU tier" in out, out
    assert "RESULT: identical tokens on every run" in out, out
