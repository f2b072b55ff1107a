"""Scheduler-side cost of the connector: vLLM's real Scheduler, 256 running requests, 4k prompts.

What is timed: ``Scheduler.schedule()`` and ``Scheduler.update_from_output()`` of each step,
which include every scheduler-role connector hook (lookup, after-alloc, build_connector_meta,
update_connector_output, request_finished). The stand-in model runners and worker-role
connectors run between them untimed (their bytes are not even written: this measures the
engine-core process only). Three engines run the same workload in the same process:

  none     no KV connector (vLLM alone)
  cpu      HiMambaConnector, CPU tier only
  storage  HiMambaConnector, CPU tier + LMCache file store (write-through off: in this
           single process the worker's write threads would otherwise compete for the GIL
           with the timed scheduler, which they never do in a real deployment)

Reported per engine: mean / p50 / p90 scheduler time per step in the prefill phase (requests
being admitted, 4k-token chunks) and in the decode phase (all 256 running), and the ratio of
each to ``none``. ``--out`` writes the same as JSON.

Run: ``.venv/bin/python -m benchmarks.bench_scheduler_step --out bench.json``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests.lifecycle.engine import LifecycleEngine  # noqa: E402
from tests.lifecycle.vllm_setup import EngineSpec, make_model_config, write_model_dir  # noqa: E402
from tests.lifecycle.workload import prompt_of  # noqa: E402


@dataclasses.dataclass
class PhaseTimes:
    prefill: list[float] = dataclasses.field(default_factory=list)
    decode: list[float] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("prefill", "decode"):
            xs = getattr(self, name)
            if not xs:
                continue
            q = statistics.quantiles(xs, n=10) if len(xs) >= 10 else [max(xs)] * 9
            out[name] = {
                "steps": len(xs),
                "mean_ms": 1e3 * statistics.fmean(xs),
                "p50_ms": 1e3 * statistics.median(xs),
                "p90_ms": 1e3 * q[8],
            }
        return out


def timed_scheduler(engine: LifecycleEngine) -> list[float]:
    """Accumulate the wall time of schedule() + update_from_output() per step."""
    sched = engine.scheduler
    per_step: list[float] = []
    real_schedule, real_update = sched.schedule, sched.update_from_output

    def schedule(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_schedule(*a, **kw)
        finally:
            per_step.append(time.perf_counter() - t)

    def update_from_output(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_update(*a, **kw)
        finally:
            per_step[-1] += time.perf_counter() - t

    sched.schedule, sched.update_from_output = schedule, update_from_output
    return per_step


def run_one(name: str, spec: EngineSpec, model_config: Any, args: argparse.Namespace) -> PhaseTimes:
    engine = LifecycleEngine(spec, model_config, verify=False, describe=False, write=False)
    try:
        for i in range(args.requests):
            prompt = prompt_of(1000 + i, args.prompt_tokens)
            engine.add_request(f"r{i}", prompt, max_tokens=args.max_tokens)
        per_step = timed_scheduler(engine)
        times = PhaseTimes()
        decode_steps = 0
        while engine.scheduler.has_requests() and decode_steps < args.decode_steps:
            running = len(engine.scheduler.running)
            all_decoding = running == args.requests and not any(
                r.is_prefill_chunk for r in engine.scheduler.running
            )
            engine.step()
            (times.decode if all_decoding else times.prefill).append(per_step[-1])
            decode_steps += all_decoding
        if decode_steps < args.decode_steps:
            raise SystemExit(
                f"{name}: only {decode_steps} steps with all {args.requests} requests decoding;"
                " raise --max-tokens"
            )
        return times
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--cpu-cache-gb", type=float, default=0.25)
    ap.add_argument(
        "--block-size",
        type=int,
        default=128,
        help="scheduler block size (vLLM picks 128 for the tests' hybrid on CPU; GPUs larger)",
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="rounds; engines alternate within each round"
    )
    ap.add_argument("--out", type=Path, help="write results as JSON here")
    args = ap.parse_args()
    logging.getLogger("vllm").setLevel(logging.ERROR)
    logging.getLogger("himamba").setLevel(logging.ERROR)

    bs = args.block_size
    max_len = args.prompt_tokens + args.max_tokens + bs
    # Attention blocks for every token of every request, plus 2-3 Mamba blocks each.
    num_blocks = args.requests * (-(-max_len // bs) + 4) + 64
    base = EngineSpec(
        block_size=bs,
        num_gpu_blocks=num_blocks,
        max_num_seqs=args.requests,
        max_num_batched_tokens=args.max_batched_tokens,
        max_model_len=max_len,
    )
    store = tempfile.mkdtemp(prefix="himamba-bench-store-")
    configs = {
        "none": dataclasses.replace(base, with_connector=False),
        "cpu": dataclasses.replace(base, connector_config={"cpu_cache_gb": args.cpu_cache_gb}),
        "storage": dataclasses.replace(
            base,
            connector_config={
                "cpu_cache_gb": args.cpu_cache_gb,
                "storage": {"url": f"file://{store}", "write_through": False},
            },
        ),
    }
    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="himamba-bench-model-")))
    model_config = make_model_config(model_dir, max_len)
    pooled = {name: PhaseTimes() for name in configs}
    wall = dict.fromkeys(configs, 0.0)
    for _ in range(args.repeats):  # interleaved, so machine drift hits every engine alike
        for name, spec in configs.items():
            t0 = time.perf_counter()
            times = run_one(name, spec, model_config, args)
            wall[name] += time.perf_counter() - t0
            pooled[name].prefill += times.prefill
            pooled[name].decode += times.decode
    results: dict[str, Any] = {}
    for name in configs:
        results[name] = pooled[name].summary()
        results[name]["wall_s"] = wall[name]
    ratios = {
        name: {
            phase: results[name][phase]["mean_ms"] / results["none"][phase]["mean_ms"]
            for phase in ("prefill", "decode")
        }
        for name in configs
    }
    print(
        f"scheduler time per step, {args.requests} requests x {args.prompt_tokens}-token "
        f"prompts, vLLM Scheduler + stand-in runner (single process, 1 worker), "
        f"{args.repeats} interleaved rounds pooled"
    )
    header = f"{'engine':8} {'phase':8} {'steps':>6} {'mean ms':>9} {'p50 ms':>8} {'p90 ms':>8} {'x none':>7}"
    print(header)
    print("-" * len(header))
    for name in configs:
        for phase in ("prefill", "decode"):
            r = results[name][phase]
            print(
                f"{name:8} {phase:8} {r['steps']:6d} {r['mean_ms']:9.2f} {r['p50_ms']:8.2f} "
                f"{r['p90_ms']:8.2f} {ratios[name][phase]:7.2f}"
            )
    if args.out:
        payload = {"params": vars(args) | {"out": str(args.out)}, "results": results,
                   "ratios_vs_none": ratios}  # fmt: skip
        args.out.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
