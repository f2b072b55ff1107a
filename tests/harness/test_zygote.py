"""A scenario forked from the pre-imported zygote returns what a fresh interpreter returns, and
plain scenario runs really go through it (a silent fallback would only cost time, so this is
where it shows)."""

from __future__ import annotations

import json
import os

from tests.harness.offline_engine import prompt
from tests.harness.subprocess_run import _ZYGOTE, child_env, run_scenario, run_script


def test_a_forked_scenario_returns_what_a_fresh_interpreter_returns(granite_model):
    args = {"model": str(granite_model), "prompts": [prompt(5, 300), prompt(6, 40)]}
    used = _ZYGOTE.used
    forked = run_scenario("baseline", args)
    argv = ["-m", "tests.harness.scenarios", "baseline", json.dumps(args)]
    fresh = run_script(argv, child_env(), 600, "scenario baseline (fresh interpreter)")
    if os.environ.get("HIMAMBA_TEST_ZYGOTE", "1") != "0":
        assert _ZYGOTE.used == used + 1, "the scenario did not run in the zygote"
    assert [o["tokens"] for o in forked["single"]] == [o["tokens"] for o in fresh["single"]]
    assert forked["block_size"] == fresh["block_size"]
