"""Engine scenarios run in a fresh process each, printing one ``RESULT {json}`` line.

Why subprocesses: vLLM keeps the worker-side KV connector in a process-global
slot, so a second engine in one process would silently reuse the first one's
connector (bound to freed caches). One scenario = one process = clean state.

Usage: python tests/scenarios.py NAME '{"model": "...", ...}'
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
from typing import Any

for _k, _v in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_CI_ENV": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)

CONNECTOR = "HiMambaConnector"
MODULE = "himamba.connector"


def prompt(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 1000) for _ in range(n)]


def make_llm(args: dict[str, Any], extra: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = dict(
        model=args["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=args.get("dtype", "float32"),
        max_model_len=args.get("max_model_len", 2048),
        max_num_seqs=8,
        enable_prefix_caching=True,
        seed=0,
    )
    if extra is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_connector_module_path=MODULE,
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
    return LLM(**kw)


def close_llm(llm: Any) -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the process exits next anyway
        pass
    del llm
    ensure_kv_transfer_shutdown()
    gc.collect()


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = 16) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return [
        {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens, "s": elapsed}
        for o in outs
    ]


def connectors(llm: Any) -> tuple[Any, Any]:
    """(scheduler-role, worker-role) connector objects of an in-process engine."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector, get_kv_transfer_group()


def leak_report(llm: Any) -> dict[str, Any]:
    sched, _ = connectors(llm)
    return sched.scheduler.leak_report()


# -- scenarios -------------------------------------------------------------------------
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
    result = {"rounds": rounds, "after": later, "stats": sched.stats(), "leaks": leak_report(llm)}
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
    """The worker fails every load (a fault a real copy cannot be made to produce)."""
    from himamba.connector import worker_side

    def broken(self: Any, job: Any) -> None:
        raise RuntimeError("injected load failure")

    worker_side.WorkerHalf._load = broken  # type: ignore[method-assign]
    llm = make_llm(args, args["extra"])
    p = args["prompts"][0]
    cold = generate(llm, [p])[0]
    llm.reset_prefix_cache()
    retry = generate(llm, [p])[0]
    sched, _ = connectors(llm)
    result = {"cold": cold, "retry": retry, "stats": sched.stats(), "leaks": leak_report(llm)}
    close_llm(llm)
    return result


def _worker_flush(timeout_s: float = 10.0) -> dict[str, Any]:
    """Let write-through land and return the worker's counters (storage included)."""
    _, worker = (None, None)
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    worker = get_kv_transfer_group()
    if worker.worker is not None and worker.worker.storage is not None:
        worker.worker.storage.flush(timeout_s)
    return worker.stats()


def storage_writer(args: dict[str, Any]) -> dict[str, Any]:
    """Compute prompts with write-through to storage, then exit (as a server would)."""
    llm = make_llm(args, args["extra"])
    outs = [generate(llm, [p])[0] for p in args["prompts"]]
    worker = _worker_flush()
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
        "worker": _worker_flush(),
        "leaks": leak_report(llm),
    }
    close_llm(llm)
    return result


def storage_outage(args: dict[str, Any]) -> dict[str, Any]:
    """Redis is killed mid-run and restarted (empty); requests must stay correct throughout."""
    from storage_fixtures import RedisServer

    redis = RedisServer(__import__("pathlib").Path(args["workdir"]))
    redis.start()
    extra = {**args["extra"], "storage": {**args["extra"]["storage"], "url": redis.url}}
    llm = make_llm(args, extra)
    a, b, c = args["prompts"]
    out: dict[str, Any] = {"before": generate(llm, [a])[0]}
    _worker_flush()
    redis.kill()
    # The CPU tier is dropped too, so storage is the only place A could come from.
    llm.reset_prefix_cache(reset_connector=True)
    out["down"] = [generate(llm, [p])[0] for p in (a, b)]
    redis.start()
    time.sleep(args.get("recover_s", 6.0))  # breaker cool-down + health probe
    out["after_restart_cold"] = generate(llm, [c])[0]
    _worker_flush()
    llm.reset_prefix_cache(reset_connector=True)
    out["after_restart_hit"] = generate(llm, [c])[0]
    sched, _ = connectors(llm)
    out["stats"] = sched.stats()
    out["worker"] = _worker_flush()
    out["leaks"] = leak_report(llm)
    close_llm(llm)
    redis.kill()
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
    )
}

if __name__ == "__main__":
    name, raw = sys.argv[1], sys.argv[2]
    res = SCENARIOS[name](json.loads(raw))
    print("RESULT " + json.dumps(res), flush=True)
