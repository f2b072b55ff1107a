"""Tiered hybrid prefix caching on a tiny model, on the CPU (`make demo`).

Builds a tiny GraniteMoeHybrid (Mamba2 + attention) offline, then serves one
long prompt three times: cold (computed), again (vLLM's own device prefix
cache), and again after resetting that cache (restored from himamba's CPU tier:
attention KV and the Mamba state at the same boundary). Prints, per run, the
cached tokens, where they came from, the time, and whether the generated
tokens equal the cold run's. A last run drops the CPU tier too, so the prefix
comes back from the storage tier (a local directory through LMCache's adapter).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

for key, value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",  # keep the demo's own lines readable
}.items():
    os.environ.setdefault(key, value)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tiny model recipe lives in the test harness


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--cpu-cache-gb", type=float, default=0.25)
    parser.add_argument("--storage", default=None, help="storage url (default: a temp dir)")
    args = parser.parse_args()
    storage_url = args.storage or f"file://{tempfile.mkdtemp(prefix='himamba-demo-')}"

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from tests.harness.tiny_models import build_granite_hybrid

    model = build_granite_hybrid()
    llm = LLM(
        model=str(model),
        enforce_eager=True,
        dtype="float32",
        max_model_len=args.prompt_tokens + args.new_tokens + 64,
        enable_prefix_caching=True,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiMambaConnector",
            kv_connector_module_path="himamba.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "cpu_cache_gb": args.cpu_cache_gb,
                "storage": {"url": storage_url},
            },
        ),
    )
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker = get_kv_transfer_group()
    rng = random.Random(0)
    prompt = [rng.randrange(3, 1000) for _ in range(args.prompt_tokens)]
    params = SamplingParams(
        temperature=0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False
    )

    def serve(label: str) -> list[int]:
        before = connector.stats()
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        after = connector.stats()
        loaded = after.get("hit_tokens", 0) - before.get("hit_tokens", 0)
        fetched = after.get("storage_fetches", 0) - before.get("storage_fetches", 0)
        cached = out.num_cached_tokens
        if cached == 0:
            source = "none"
        elif not loaded:
            source = "vLLM device cache"
        else:
            source = "storage -> CPU tier" if fetched else "himamba CPU tier"
        tokens = list(out.outputs[0].token_ids)
        match = "-" if not runs else ("yes" if tokens == runs[0] else "NO")
        print(
            f"{label:<28} cached={cached:>5}  from={source:<18} "
            f"time={elapsed * 1000:8.1f} ms  tokens match cold run: {match}",
            flush=True,
        )
        return tokens

    runs: list[list[int]] = []
    print(f"\nmodel: {model.name}, prompt: {len(prompt)} tokens\n")
    runs.append(serve("1. cold"))
    runs.append(serve("2. repeat"))
    llm.reset_prefix_cache()
    runs.append(serve("3. repeat after GPU reset"))
    worker.worker.flush_storage(10.0)  # let write-through land
    llm.reset_prefix_cache()  # drop the device cache ...
    connector.drop_host_tier()  # ... and the CPU tier; storage stays (as after a restart)
    runs.append(serve("4. after GPU+CPU reset"))
    stats = connector.stats()
    wstats = worker.stats()
    print(
        f"\nCPU tier: {stats['host_kv_used']}/{stats['host_kv_capacity']} KV blocks, "
        f"{stats['host_mamba_used']}/{stats['host_mamba_capacity']} Mamba states; "
        f"storage ({storage_url}): {int(wstats.get('storage_puts_ok', 0))} objects written, "
        f"{int(wstats.get('storage_gets_ok', 0))} read back"
    )
    ok = all(r == runs[0] for r in runs)
    print("RESULT:", "identical tokens on every run" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
