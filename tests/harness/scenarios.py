"""Engine scenarios run in a fresh process each, printing one ``RESULT {json}`` line.

Why subprocesses: vLLM keeps the worker-side KV connector in a process-global
slot, so a second engine in one process would silently reuse the first one's
connector (bound to freed caches). One scenario = one process = clean state.

Usage: python -m tests.harness.scenarios NAME '{"model": "...", ...}' (from the repository root)
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from tests.harness.offline_engine import (
    ENGINE,
    cache_dtypes,
    close_llm,
    connectors,
    drop_host_tier,
    flush_worker,
    generate,
    idle_steps,
    leak_report,
    make_llm,
    prompt,
)


def baseline(args: dict[str, Any]) -> dict[str, Any]:
    """Tokens from an engine with no connector at all."""
    llm = make_llm(args, None)
    out = [generate(llm, [p])[0] for p in args["prompts"]]
    batch = generate(llm, args["batch"]) if args.get("batch") else []
    close_llm(llm)
    return {"single": out, "batch": batch}


def cpu_tier(args: dict[str, Any]) -> dict[str, Any]:
    """Each prompt: cold, GPU hit, then reset of the GPU cache and a CPU-tier hit."""
    llm = make_llm(args, args["extra"])
    rounds = []
    for p in args["prompts"]:
        cold = generate(llm, [p])[0]
        gpu = generate(llm, [p])[0]
        llm.reset_prefix_cache()
        cpu = generate(llm, [p])[0]
        llm.reset_prefix_cache()
        rounds.append({"cold": cold, "gpu": gpu, "cpu": cpu})
    later = [generate(llm, [p])[0] for p in args.get("after", [])]
    sched, _ = connectors(llm)
    result = {
        "rounds": rounds,
        "after": later,
        "stats": sched.stats(),
        "leaks": leak_report(llm),
        "cache_dtypes": cache_dtypes(llm),
    }
    close_llm(llm)
    return result


def batch_pressure(args: dict[str, Any]) -> dict[str, Any]:
    """A batch twice, the GPU cache reset in between, with a CPU tier too small for all."""
    llm = make_llm(args, args["extra"])
    first = generate(llm, args["batch"])
    llm.reset_prefix_cache()
    second = generate(llm, args["batch"])
    llm.reset_prefix_cache()
    third = generate(llm, args["batch"])
    sched, _ = connectors(llm)
    result = {
        "first": first,
        "second": second,
        "third": third,
        "stats": sched.stats(),
        "leaks": leak_report(llm),
    }
    close_llm(llm)
    return result


def load_failure(args: dict[str, Any]) -> dict[str, Any]:
    """Every host -> device copy fails on the copy engine's thread (a fault a real copy cannot
    be made to produce)."""
    from himamba.tiers.transfer import CopyPlan

    real = CopyPlan.run_host

    def broken(plan: CopyPlan) -> None:
        if not plan.to_host and plan.nbytes:
            raise RuntimeError("injected load failure")
        real(plan)

    CopyPlan.run_host = broken  # type: ignore[method-assign]
    llm = make_llm(args, args["extra"])
    p = args["prompts"][0]
    cold = generate(llm, [p])[0]
    llm.reset_prefix_cache()
    try:
        retry: dict[str, Any] = generate(llm, [p])[0]
    except Exception as exc:  # noqa: BLE001 - policy "fail" may surface as an error
        retry = {"error": repr(exc)}
    sched, _ = connectors(llm)
    core = llm.llm_engine.engine_core.engine_core
    result = {
        "cold": cold,
        "retry": retry,
        "policy": core.scheduler.vllm_config.kv_transfer_config.kv_load_failure_policy,
        "stats": sched.stats(),
        "leaks": leak_report(llm),
    }
    close_llm(llm)
    return result


def storage_writer(args: dict[str, Any]) -> dict[str, Any]:
    """Compute prompts with write-through to storage, then exit (as a server would)."""
    llm = make_llm(args, args["extra"])
    outs = [generate(llm, [p])[0] for p in args["prompts"]]
    worker = flush_worker()
    close_llm(llm)
    return {"outs": outs, "worker": worker}


def storage_reader(args: dict[str, Any]) -> dict[str, Any]:
    """A fresh process sharing only the storage: serve the prompts again."""
    llm = make_llm(args, args["extra"])
    outs = [generate(llm, [p])[0] for p in args["prompts"]]
    sched, _ = connectors(llm)
    result = {
        "outs": outs,
        "stats": sched.stats(),
        "worker": flush_worker(),
        "leaks": leak_report(llm),
    }
    close_llm(llm)
    return result


def _until_storage_closed(llm: Any, timeout_s: float) -> float:
    """Wait until both roles' stores are healthy again (breaker cool-down, then a health probe
    through a fresh adapter: seconds on an idle box, longer on a busy one); the time it took."""
    from himamba.tiers.circuit_breaker import BreakerState

    sched, worker = connectors(llm)
    stores = (sched.scheduler.storage.store, worker.worker.storage.store)
    start = time.monotonic()
    while any(s.breaker_state is not BreakerState.CLOSED for s in stores):
        if time.monotonic() - start > timeout_s:
            states = [s.breaker_state.value for s in stores]
            raise TimeoutError(f"storage still unhealthy after {timeout_s} s: {states}")
        time.sleep(0.1)
    return time.monotonic() - start


def storage_outage(args: dict[str, Any]) -> dict[str, Any]:
    """Redis is killed mid-run and restarted (empty); requests must stay correct throughout."""
    from tests.harness.redis_server import RedisServer

    redis = RedisServer(__import__("pathlib").Path(args["workdir"]))
    redis.start()
    extra = {**args["extra"], "storage": {**args["extra"]["storage"], "url": redis.url}}
    llm = make_llm(args, extra)
    a, b, c = args["prompts"]
    out: dict[str, Any] = {"before": generate(llm, [a])[0]}
    flush_worker()
    redis.kill()
    # The CPU tier is dropped too, so storage is the only place A could come from.
    drop_host_tier(llm)
    out["down"] = [generate(llm, [p])[0] for p in (a, b)]
    redis.start()
    out["recovered_s"] = _until_storage_closed(llm, args.get("recover_s", 60.0))
    out["after_restart_cold"] = generate(llm, [c])[0]
    flush_worker()
    drop_host_tier(llm)
    out["after_restart_hit"] = generate(llm, [c])[0]
    sched, _ = connectors(llm)
    out["stats"] = sched.stats()
    out["worker"] = flush_worker()
    out["leaks"] = leak_report(llm)
    close_llm(llm)
    redis.kill()
    return out


def storage_reset(args: dict[str, Any]) -> dict[str, Any]:
    """A weight update's reset: what was stored before must not be served after it."""
    llm = make_llm(args, args["extra"])
    a = args["prompts"][0]
    out: dict[str, Any] = {"cold": generate(llm, [a])[0]}
    flush_worker()
    llm.reset_prefix_cache(reset_connector=True)  # host tier and storage epoch
    out["after_reset"] = generate(llm, [a])[0]
    flush_worker()
    llm.reset_prefix_cache()  # GPU only: the post-reset copy must still be served
    out["again"] = generate(llm, [a])[0]
    sched, _ = connectors(llm)
    out["stats"] = sched.stats()
    out["leaks"] = leak_report(llm)
    close_llm(llm)
    return out


def storage_steps(args: dict[str, Any]) -> dict[str, Any]:
    """Engine steps a cold request takes (storage configured or not), then a storage hit."""
    llm = make_llm(args, args["extra"])
    a, b = args["prompts"]
    sched, _ = connectors(llm)
    before = sched.stats().get("steps", 0)
    cold = generate(llm, [a])[0]
    steps = sched.stats()["steps"] - before
    out = {"cold": cold, "cold_steps": steps, "second": generate(llm, [b])[0]}
    out["stats"] = sched.stats()
    out["leaks"] = leak_report(llm)
    close_llm(llm)
    return out


def best_effort(args: dict[str, Any]) -> dict[str, Any]:
    """best_effort never waits for storage, yet its fetch runs in the background: a request
    queued behind another (one sequence at a time) finds its prefix in the host tier when it
    is finally scheduled."""
    llm = make_llm({**args, "max_num_seqs": 1}, args["extra"])
    a, b = args["prompts"][:2]
    out: dict[str, Any] = {"alone": generate(llm, [a])[0]}  # nothing queued ahead: no wait
    # b arrives while a long decode holds the only sequence slot: its probe and fetch run
    # meanwhile, from on_new_request, with no lookup of b in between.
    _, out["queued"] = generate(llm, [prompt(99, 16), b], [args["blocker_tokens"], 16])
    sched, _ = connectors(llm)
    out["stats"] = sched.stats()
    out["leaks"] = leak_report(llm)
    close_llm(llm)
    return out


def _lookup_waits(sched: Any) -> dict[str, list[float]]:
    """Per request, [first lookup, first lookup that answered, lookups answered "ask again"]:
    how long the scheduler held it back for storage, measured in the lookups themselves, so a
    slow box does not make a request that never waited look as if it did (wall time would)."""
    waits: dict[str, list[float]] = {}
    real = sched.get_num_new_matched_tokens

    def lookup(request: Any, *a: Any, **kw: Any) -> Any:
        span = waits.setdefault(request.request_id, [time.monotonic(), 0.0, 0])
        answer = real(request, *a, **kw)
        if answer[0] is None:
            span[2] += 1  # "ask again next step"
        elif not span[1]:
            span[1] = time.monotonic()
        return answer

    sched.get_num_new_matched_tokens = lookup
    return waits


def slow_storage(args: dict[str, Any]) -> dict[str, Any]:
    """Storage that answers, but slowly: waits time out, the breaker opens, requests stop
    waiting. The delay is injected around the real fs adapter (no real disk is this slow)."""
    from himamba.tiers import lmcache_store

    real = lmcache_store.create_lmcache_adapter

    def slow_adapter(spec: dict[str, Any]) -> Any:
        adapter = real(spec)
        for name in ("submit_lookup_and_lock_task", "submit_load_task", "submit_store_task"):
            submit = getattr(adapter, name)

            def delayed(*a: Any, _submit: Any = submit, **kw: Any) -> Any:
                time.sleep(args["delay_s"])
                return _submit(*a, **kw)

            setattr(adapter, name, delayed)
        return adapter

    lmcache_store.create_lmcache_adapter = slow_adapter
    llm = make_llm(args, args["extra"])
    sched, _ = connectors(llm)
    waits = _lookup_waits(sched)
    outs = [generate(llm, [p])[0] for p in args["prompts"]]
    for o, w in zip(outs, waits.values(), strict=True):
        o["wait_s"], o["asked_again"] = w[1] - w[0], w[2]
    out = {"outs": outs, "stats": sched.stats(), "leaks": leak_report(llm)}
    out["breaker"] = str(sched.scheduler.storage.store.breaker_state)
    close_llm(llm)
    return out


def conversation(args: dict[str, Any]) -> dict[str, Any]:
    """A multi-turn chat in token ids: turn t's prompt = turn t-1's prompt + its output + new
    tokens (a turn's ``edit``, ``{position: token}``, rewrites tokens of that history first).
    Before each turn the GPU cache is reset (and, with ``storage_only``, the CPU tier too), so
    every hit past vLLM's own cache comes from the connector's tiers. After each turn the
    engine steps while its scheduler has work left, as a served engine does between
    requests."""
    extra = args.get("extra")
    llm = make_llm(args, extra)
    history: list[int] = []
    turns = []
    for t in args["turns"]:
        for pos, token in t.get("edit", {}).items():
            history[int(pos)] = token
        p = history + t["new"]
        if args.get("storage_only"):
            drop_host_tier(llm)
        else:
            llm.reset_prefix_cache()
        r = generate(llm, [p], t["max_tokens"])[0]
        r["idle_steps"] = idle_steps(llm)
        turns.append({**r, "prompt_len": len(p)})
        history = p + r["tokens"]
    out: dict[str, Any] = {"turns": turns}
    if extra is not None:
        out["worker"] = flush_worker()
        sched, _ = connectors(llm)
        out["stats"] = sched.stats()
        out["leaks"] = leak_report(llm)
    close_llm(llm)
    return out


def host_states(args: dict[str, Any]) -> dict[str, Any]:
    """One request; then the CPU tier's Mamba pool: how many states it left behind."""
    llm = make_llm(args, args["extra"])
    outs = [generate(llm, [p], args.get("max_tokens", 16))[0] for p in args["prompts"]]
    sched, _ = connectors(llm)
    out = {"outs": outs, "stats": sched.stats(), "leaks": leak_report(llm)}
    close_llm(llm)
    return out


def write_policy(args: dict[str, Any]) -> dict[str, Any]:
    """A popular prompt served ``repeats`` times (CPU-tier hits after GPU resets), then others
    once each; storage puts after every request. The process then exits cleanly (shutdown
    flush under write_back)."""
    llm = make_llm(args, args["extra"])
    popular, others = args["prompts"][0], args["prompts"][1:]
    outs, puts = [], []
    for p in [popular] * args["repeats"] + others:
        llm.reset_prefix_cache()
        outs.append(generate(llm, [p])[0])
        puts.append(flush_worker()["storage_puts_ok"])
    sched, _ = connectors(llm)
    out = {"outs": outs, "puts": puts, "stats": sched.stats(), "leaks": leak_report(llm)}
    close_llm(llm)
    return out


def storage_control(args: dict[str, Any]) -> dict[str, Any]:
    """Detach and re-attach storage at run time through vLLM's collective_rpc (a worker
    extension), then attach another store; objects on disk show where writes went."""
    from pathlib import Path

    llm = make_llm({**args, "worker_extension": True}, args["extra"])
    a, b, c = args["prompts"]
    first, second = Path(args["dirs"][0]), Path(args["dirs"][1])

    def objects(d: Path) -> int:
        flush_worker()
        return sum(1 for p in d.rglob("*.data") if p.is_file())

    def control(*call: Any) -> list[dict[str, Any]]:
        return llm.collective_rpc("himamba_control", args=call)

    out: dict[str, Any] = {"a": generate(llm, [a])[0], "objects_a": objects(first)}
    out["detach"] = control("detach_storage")
    out["b"] = generate(llm, [b])[0]  # the scheduler learns of the detach in this step
    out["objects_b"] = objects(first)
    drop_host_tier(llm)
    out["a_detached"] = generate(llm, [a])[0]
    out["attach"] = control("attach_storage")
    out["c"] = generate(llm, [c])[0]
    out["objects_c"] = objects(first)
    drop_host_tier(llm)
    out["a_attached"] = generate(llm, [a])[0]
    out["attach_other"] = control("attach_storage", {"url": f"file://{second}"})
    out["b_other"] = generate(llm, [b])[0]
    out["objects_other"] = objects(second)
    out["status"] = control("status")
    out["leaks"] = leak_report(llm)
    close_llm(llm)
    return out


def repeat(args: dict[str, Any]) -> dict[str, Any]:
    """A prompt cold, again (vLLM's own cache), again after a GPU reset (the connector): no
    access to the connector objects, so it also runs with a multi-process engine."""
    llm = make_llm(args, args.get("extra"))
    a = args["prompts"][0]
    out = {"cold": generate(llm, [a])[0], "gpu": generate(llm, [a])[0]}
    llm.reset_prefix_cache()
    out["reset"] = generate(llm, [a])[0]
    close_llm(llm)
    return out


SCENARIOS = {
    f.__name__: f
    for f in (
        baseline,
        cpu_tier,
        batch_pressure,
        load_failure,
        storage_writer,
        storage_reader,
        storage_outage,
        storage_reset,
        storage_steps,
        best_effort,
        slow_storage,
        conversation,
        host_states,
        write_policy,
        storage_control,
        repeat,
    )
}


def run(name: str, raw: str) -> None:
    """Run scenario ``name`` on its JSON arguments and print its ``RESULT`` line (here and in a
    child forked from ``zygote``)."""
    res = SCENARIOS[name](json.loads(raw))
    res.setdefault("block_size", ENGINE.get("block_size"))
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
