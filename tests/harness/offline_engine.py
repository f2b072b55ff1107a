"""One offline vLLM engine (``vllm.LLM``) with the connector, for the scenarios, the E2E tests'
child processes and the benchmarks: build it, generate, reach its connectors, close it.

The environment defaults below are set at import, before vLLM is: vLLM reads most of them when
``vllm.envs`` is first imported.
"""

from __future__ import annotations

import gc
import os
import random
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
# The scheduler block size of the last engine built: vLLM derives it at start-up from page sizes
# (it differs between machines and package versions), so every RESULT carries it for the tests.
ENGINE: dict[str, int] = {}


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
        max_num_seqs=args.get("max_num_seqs", 8),
        enable_prefix_caching=True,
        seed=0,
    )
    if args.get("worker_extension"):
        kw["worker_extension_cls"] = "himamba.connector.control.HiMambaWorkerExtension"
    if args.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = args["max_num_batched_tokens"]
    for key in ("mamba_ssm_cache_dtype", "kv_cache_dtype"):  # float32 SSM states, fp8 KV ...
        if args.get(key):
            kw[key] = args[key]
    if args.get("tp", 1) > 1:
        # Workers in spawned processes; the engine core stays in this process.
        kw["tensor_parallel_size"] = args["tp"]
        kw["distributed_executor_backend"] = "mp"
    if extra is not None:
        policy = {"kv_load_failure_policy": args["policy"]} if "policy" in args else {}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_connector_module_path=MODULE,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            **policy,
        )
    llm = LLM(**kw)
    ENGINE["block_size"] = int(llm.llm_engine.vllm_config.cache_config.block_size)
    return llm


def close_llm(llm: Any) -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the process exits next anyway
        pass
    del llm
    ensure_kv_transfer_shutdown()
    gc.collect()


def generate(
    llm: Any, prompts: list[list[int]], max_tokens: int | list[int] = 16
) -> list[dict[str, Any]]:
    """Greedy generation; ``max_tokens`` for all prompts or one per prompt."""
    from vllm import SamplingParams

    per = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    sp = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in per
    ]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return [
        {
            "tokens": list(o.outputs[0].token_ids),
            "cached": o.num_cached_tokens,
            "finish": o.outputs[0].finish_reason,
            "s": elapsed,
        }
        for o in outs
    ]


def connectors(llm: Any) -> tuple[Any, Any]:
    """(scheduler-role, worker-role) connector objects of an in-process engine; the worker is
    None when workers run in their own processes (TP)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector, get_kv_transfer_group() if has_kv_transfer_group() else None


def cache_dtypes(llm: Any) -> dict[str, list[list[str]]]:
    """The dtypes the engine laid its cache groups out in: each Mamba-type group's state dtypes
    (conv, ssm, ...) and each attention group's KV dtype."""
    core = llm.llm_engine.engine_core.engine_core
    out: dict[str, list[list[str]]] = {"mamba": [], "attention": []}
    for group in core.scheduler.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        dtypes = getattr(spec, "dtypes", None)
        kind, found = ("mamba", dtypes) if dtypes is not None else ("attention", [spec.dtype])
        out[kind].append([str(d).removeprefix("torch.") for d in found])
    return out


def idle_steps(llm: Any, limit: int = 16) -> int:
    """Step the in-process engine while its scheduler still has work but no request, as a
    served engine's busy loop does between requests (``LLM.generate`` stops at the last
    output): a finished request's delayed block free and its tail's copy happen here.
    Returns the steps taken."""
    core = llm.llm_engine.engine_core.engine_core
    steps = 0
    while steps < limit and core.scheduler.has_requests():
        core.step_fn()
        steps += 1
    return steps


def drop_host_tier(llm: Any) -> None:
    """GPU cache and CPU tier emptied, storage kept: the next hit can only come from storage."""
    llm.reset_prefix_cache()
    connectors(llm)[0].drop_host_tier()


def leak_report(llm: Any) -> dict[str, Any]:
    sched, _ = connectors(llm)
    return sched.leak_report()


# -- scenarios -------------------------------------------------------------------------


def flush_worker(timeout_s: float = 10.0) -> dict[str, Any]:
    """Let write-through land and return the worker's counters (storage included); empty when
    the workers run in other processes (TP), whose stores flush when the engine closes."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    if not has_kv_transfer_group():
        return {}
    worker = get_kv_transfer_group()
    if worker.worker is not None and worker.worker.storage is not None:
        worker.worker.flush_storage(timeout_s)
    return worker.stats()
