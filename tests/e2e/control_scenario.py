"""Run-time storage control on a real offline engine, in a fresh process (see tests/harness/scenarios.py
for why one engine per process); prints one ``RESULT {json}`` line.

Detach, re-attach and attach another store through vLLM's ``collective_rpc`` (a worker
extension). A switch is asynchronous: the call answers at once, each rank's new store goes live
at a step boundary once it is open, and the scheduler half follows once the rank's report
reached it; ``status`` says where each half is.

Usage: python -m tests.e2e.control_scenario '{"model": "...", "prompts": [...], ...}'
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from tests.harness.offline_engine import (
    ENGINE,
    close_llm,
    drop_host_tier,
    flush_worker,
    generate,
    leak_report,
    make_llm,
)


def storage_control(args: dict[str, Any]) -> dict[str, Any]:
    llm = make_llm({**args, "worker_extension": True}, args["extra"])
    a, b, c = args["prompts"]
    first, second = Path(args["dirs"][0]), Path(args["dirs"][1])

    def objects(d: Path) -> int:
        """KV and Mamba objects in ``d`` (not the health probes each open store writes)."""
        flush_worker()
        return sum(
            1 for p in d.rglob("*.data") if p.is_file() and p.name.split("@")[2:3] in (["0"], ["1"])
        )

    def control(*call: Any) -> list[dict[str, Any]]:
        return llm.collective_rpc("himamba_control", args=call)

    def settle(want: str, scheduler: bool = True, timeout_s: float = 60.0) -> list[dict]:
        """Status until every rank (and the scheduler half) report ``want``. A rank's store
        goes live at any call or step once it is open; its report to the scheduler half
        travels with the next engine step, which runs whenever the engine has work (the
        scheduler half keeps it busy while it prepares its own store)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = control("status")
            if all(s["storage"] == want and (s["scheduler"] == want or not scheduler)
                   for s in status):  # fmt: skip
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"storage never settled on {want}: {status}")
            llm.llm_engine.step()
            time.sleep(0.01)

    out: dict[str, Any] = {"a": generate(llm, [a])[0], "objects_a": objects(first)}
    out["detach"] = control("detach_storage")
    out["b"] = generate(llm, [b])[0]  # its first step carries the report to the scheduler
    out["detach_settled"] = settle("detached")
    out["objects_b"] = objects(first)
    drop_host_tier(llm)
    out["a_detached"] = generate(llm, [a])[0]
    out["attach"] = control("attach_storage")
    settle("attached", scheduler=False)  # C's blocks are then written through
    out["c"] = generate(llm, [c])[0]
    out["attach_settled"] = settle("attached")
    out["objects_c"] = objects(first)
    drop_host_tier(llm)
    out["a_attached"] = generate(llm, [a])[0]
    out["attach_other"] = control("attach_storage", {"url": f"file://{second}"})
    settle("attached", scheduler=False)
    out["b_other"] = generate(llm, [b])[0]
    out["other_settled"] = settle("attached")
    out["objects_other"] = objects(second)
    out["bad"] = None
    try:
        control("attach_storage", {"url": "ftp://nowhere/x"})
    except Exception as exc:  # noqa: BLE001 - the caller's error, reported
        out["bad"] = str(exc)
    out["after_bad"] = generate(llm, [c])[0]
    out["leaks"] = leak_report(llm)
    close_llm(llm)
    return out


if __name__ == "__main__":
    res = storage_control(json.loads(sys.argv[1]))
    res.setdefault("block_size", ENGINE.get("block_size"))
    print("RESULT " + json.dumps(res), flush=True)
