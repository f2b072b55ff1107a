"""Run-time storage control through vLLM's collective_rpc on a real engine: detach stops every
storage read and write, attach brings the configured store back, another store can be attached,
and a bad storage section is the caller's error while the engine keeps serving."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.harness.offline_engine import prompt
from tests.harness.subprocess_run import child_env, run_script

pytestmark = pytest.mark.e2e


def run_control_scenario(args: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    argv = ["-m", "tests.e2e.control_scenario", json.dumps(args)]
    return run_script(argv, child_env(), timeout, "control scenario")


def test_storage_detaches_and_attaches_without_a_restart(granite_model, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    a, b, c = (prompt(101 + i, 1000) for i in range(3))
    out = run_control_scenario(
        {
            "model": str(granite_model),
            "prompts": [a, b, c],
            "dirs": [str(first), str(second)],
            "extra": {"cpu_cache_gb": 0.05, "storage": {"url": f"file://{first}"}},
        },
    )
    hit = (len(a) - 1) // out["block_size"] * out["block_size"]
    assert out["objects_a"] > 0
    assert [r["storage"] for r in out["detach"]] == ["detached"]  # at once
    assert out["objects_b"] == out["objects_a"]  # nothing written while detached
    assert out["a_detached"]["cached"] == 0  # nor read: A is only in storage now
    assert out["a_detached"]["tokens"] == out["a"]["tokens"]
    # An attach answers before the store is open; both halves then follow.
    assert [r["storage"] for r in out["attach"]] == ["attaching"]
    assert out["attach"][0]["target"] == f"file://{first}"
    assert out["objects_c"] > out["objects_b"]  # writes resume
    assert out["a_attached"]["cached"] == hit  # and reads: A comes back from storage
    assert out["a_attached"]["tokens"] == out["a"]["tokens"]
    assert out["attach_other"][0]["target"] == f"file://{second}"
    assert out["other_settled"][0]["target"] == f"file://{second}"
    assert out["objects_other"] > 0
    assert "storage.url" in out["bad"]  # the caller's error, naming the field
    assert out["after_bad"]["tokens"] == out["c"]["tokens"]
    assert out["leaks"]["locked_entries"] == 0 and out["leaks"]["inflight_loads"] == 0
