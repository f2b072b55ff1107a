"""End-of-test accounting: nothing may stay held by vLLM or by either connector role."""

from __future__ import annotations

import time
from typing import Any

from .engine import LifecycleEngine


def connector_report(conn: Any) -> dict[str, Any]:
    """The connector's own leak report (scheduler or worker role)."""
    report = getattr(conn, "leak_report", None)
    if callable(report):
        return dict(report())
    # Older connectors: the scheduler half has one; the worker half may not.
    half = conn.scheduler if conn.scheduler is not None else conn.worker
    report = getattr(half, "leak_report", None)
    if callable(report):
        return dict(report())
    raise AssertionError(f"{type(conn).__name__} exposes no leak_report() for this role")


def report_problems(report: dict[str, Any]) -> list[str]:
    """Counts must be 0, flags (e.g. ``slots_conserved``) must be True."""
    bad = []
    for key, value in report.items():
        if isinstance(value, bool):
            if not value:
                bad.append(f"{key}=False")
        elif isinstance(value, (int, float)) and value:
            bad.append(f"{key}={value}")
    return bad


def vllm_problems(engine: LifecycleEngine) -> list[str]:
    s = engine.scheduler
    problems = []
    if s.requests:
        problems.append(
            f"requests {{{', '.join(f'{k}: {r.status.name}' for k, r in s.requests.items())}}}"
        )
    for name in ("running", "finished_recving_kv_req_ids", "failed_recving_kv_req_ids",
                 "_inflight_prefills", "deferred_frees"):  # fmt: skip
        held = getattr(s, name, ())
        if held:
            problems.append(f"{name} not empty ({len(held)})")
    if len(s.waiting) or len(s.kv_holding_waiting):
        problems.append(f"waiting queues hold {len(s.waiting) + len(s.kv_holding_waiting)}")
    pool = s.kv_cache_manager.block_pool
    free = pool.free_block_queue.num_free_blocks
    if free != pool.num_gpu_blocks - 1:
        problems.append(f"{pool.num_gpu_blocks - 1 - free} GPU blocks not free")
    held_blocks = [b.block_id for b in pool.blocks[1:] if b.ref_cnt]
    if held_blocks:
        problems.append(f"blocks with ref_cnt > 0: {held_blocks[:10]}")
    for mgr in s.kv_cache_manager.coordinator.single_type_managers:
        if mgr.req_to_blocks:
            problems.append(f"{type(mgr).__name__} still maps {list(mgr.req_to_blocks)[:5]}")
    return problems


# Worker report entries that are state, not leaks, up to a bound the scheduler knows: under
# write-back a host slot may hold bytes storage lacks for as long as the CPU tier keeps them.
HOST_STATE_KEYS = ("storage_dirty_slots",)


def host_slots_in_use(engine: LifecycleEngine) -> int:
    stats = engine.connector.stats()
    return int(stats.get("host_kv_used", 0)) + int(stats.get("host_mamba_used", 0))


def leak_problems(engine: LifecycleEngine) -> list[str]:
    problems = [f"vLLM: {p}" for p in vllm_problems(engine)]
    problems += [
        f"scheduler connector: {p}" for p in report_problems(connector_report(engine.connector))
    ]
    for runner in engine.runners:
        rep = connector_report(runner.connector)
        in_use = None
        for key in HOST_STATE_KEYS:
            held = rep.pop(key, 0)
            if held:
                in_use = host_slots_in_use(engine) if in_use is None else in_use
                if held > in_use:
                    problems.append(
                        f"worker connector rank {runner.rank}: {key}={held} > host slots the "
                        f"scheduler holds ({in_use})"
                    )
        problems += [f"worker connector rank {runner.rank}: {p}" for p in report_problems(rep)]
        if runner.requests:
            problems.append(f"rank {runner.rank} runner still tracks {list(runner.requests)[:5]}")
    return problems


def settled_leaks(engine: LifecycleEngine, settle_s: float = 10.0) -> list[str]:
    """Run the engine to idle, give in-flight storage I/O up to ``settle_s`` (with empty
    steps, as any later traffic would give it), then list what is still held."""
    engine.run_until_idle()
    deadline = time.monotonic() + settle_s
    problems = leak_problems(engine)
    while problems and time.monotonic() < deadline:
        engine.idle_steps(1)
        time.sleep(0.01)
        problems = leak_problems(engine)
    return problems


def assert_no_leaks(engine: LifecycleEngine, settle_s: float = 10.0) -> None:
    """Run the engine to idle, settle (see ``settled_leaks``), require that nothing is held."""
    problems = settled_leaks(engine, settle_s)
    assert not problems, "leaked after the engine went idle:\n  " + "\n  ".join(problems)
