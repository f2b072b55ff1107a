"""What ``partial_tail_hits`` costs and saves in prefill: tokens computed with and without it.

Runs the churn soak (vLLM's real scheduler, stand-in model runners, an LMCache file store and
random control between steps; ``tests/lifecycle/churn_soak.py``) with every fault off, on five
workloads, each with tails off and on, over several seeds:

  one-shot              write-through-selective, no request continues another (tails only evict)
  turns                 write-through, 30 % of requests continue a finished one (a next turn)
  turns-async           write-back under vLLM's AsyncScheduler, 30 % next turns
  turns-async-v2        the same under Model Runner V2's call order (a GPU engine's default),
                        with himamba's step-start hook
  turns-async-v2-nohook the same without that hook (tails whose blocks are reused are dropped)

Tokens computed is the sum of scheduled tokens over all steps (lower is better); vLLM hits are
its own device prefix cache, connector hits what the connector loaded. The soak's storage
threads, deadlines and control run on wall-clock time, so one seed's figure moves by several
per cent from run to run: compare means over seeds, never one run.

Run: ``.venv/bin/python -m benchmarks.bench_tail_cost --seeds 1 2 3 4 5 --out tails.json``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests.lifecycle.churn_soak import ChurnReport, ChurnVariant, run_churn_soak  # noqa: E402
from tests.lifecycle.engine import LifecycleEngine  # noqa: E402
from tests.lifecycle.vllm_setup import EngineSpec, make_model_config, write_model_dir  # noqa: E402

# A CPU tier with room (256 KV, 64 Mamba slots) and a device cache larger than the soak's (320
# blocks), so the figures are about tails, not about a starved tier.
ROOMY = {"kv_slots": 256, "mamba_slots": 64, "num_gpu_blocks": 320}
WORKLOADS = {
    "one-shot": ChurnVariant("write_through_selective", **ROOMY),
    "turns": ChurnVariant("write_through", conversation_share=0.3, **ROOMY),
    "turns-async": ChurnVariant(
        "write_back", async_scheduling=True, conversation_share=0.3, **ROOMY
    ),
    # A GPU engine's defaults: async scheduling and Model Runner V2's call order, with
    # himamba's step-start hook and without it (HIMAMBA_V2_STEP_HOOK=0: tails whose blocks
    # vLLM hands out in the copying step are given up).
    "turns-async-v2": ChurnVariant(
        "write_back",
        async_scheduling=True,
        model_runner_v2=True,
        conversation_share=0.3,
        **ROOMY,
    ),
    "turns-async-v2-nohook": ChurnVariant(
        "write_back",
        async_scheduling=True,
        model_runner_v2=True,
        v2_step_hook=False,
        conversation_share=0.3,
        **ROOMY,
    ),
}


@dataclasses.dataclass
class Run:
    workload: str
    tails: bool
    seed: int
    steps: int = 0
    tokens_computed: int = 0
    vllm_hits: int = 0
    connector_hits: int = 0
    tail_hits: int = 0
    storage_tails_seen: int = 0
    tails_overwritten: int = 0


def one_run(model_config: Any, workload: str, tails: bool, seed: int, n: int) -> Run:
    variant = dataclasses.replace(WORKLOADS[workload], partial_tails=tails)
    run = Run(workload, tails, seed)

    def build(verify: bool = True, describe: bool = True, **fields: Any) -> LifecycleEngine:
        spec = dataclasses.replace(EngineSpec(), **fields)
        engine = LifecycleEngine(spec, model_config, verify=verify, describe=describe)
        schedule = engine.schedule

        def counted():  # the scheduler's output, with its token count noted
            so = schedule()
            run.tokens_computed += so.total_num_scheduled_tokens
            run.steps += bool(so.total_num_scheduled_tokens)
            return so

        engine.schedule = counted
        return engine

    with tempfile.TemporaryDirectory(prefix="himamba-tails-") as root:
        report = ChurnReport(variant.name, n, seed)
        run_churn_soak(
            build, Path(root), variant, n, seed=seed, report=report, audit=False, faults=False
        )
    run.vllm_hits, run.connector_hits = report.hits.local_hits, report.hits.external_hits
    counts = report.tails()
    run.tail_hits, run.storage_tails_seen = counts["tail_hits"], counts["storage_tails_seen"]
    run.tails_overwritten = counts["tails_overwritten"]
    return run


def summary(runs: list[Run]) -> list[str]:
    lines = [
        "| workload | tails | tokens computed (mean, min-max) | vs off | vLLM hits | "
        "connector hits | tail hits (CPU) | tails found in storage | tails given up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in WORKLOADS:
        off_mean = None
        for tails in (False, True):
            rs = [r for r in runs if r.workload == workload and r.tails == tails]
            if not rs:
                continue
            toks = [r.tokens_computed for r in rs]
            mean = statistics.mean(toks)
            if not tails:
                off_mean = mean
            ratio = f"{(mean / off_mean - 1) * 100:+.1f} %" if tails and off_mean else ""
            lines.append(
                f"| {workload} | {'on' if tails else 'off'} | {mean:,.0f} ({min(toks):,}-"
                f"{max(toks):,}) | {ratio} | {statistics.mean(r.vllm_hits for r in rs):,.0f} | "
                f"{statistics.mean(r.connector_hits for r in rs):,.0f} | "
                f"{statistics.mean(r.tail_hits for r in rs):,.0f} | "
                f"{statistics.mean(r.storage_tails_seen for r in rs):,.0f} | "
                f"{statistics.mean(r.tails_overwritten for r in rs):,.0f} |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--requests", type=int, default=10_000, help="per run")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--out", type=Path, help="write every run as JSON")
    args = ap.parse_args()
    for name in ("vllm", "himamba"):
        logging.getLogger(name).setLevel(logging.ERROR)
    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="himamba-bench-model-")))
    model_config = make_model_config(model_dir, max_model_len=EngineSpec().max_model_len)
    runs = []
    for seed in args.seeds:
        for workload in args.workloads:
            for tails in (False, True):
                run = one_run(model_config, workload, tails, seed, args.requests)
                print(json.dumps(dataclasses.asdict(run)), flush=True)
                runs.append(run)
    print("\n".join(summary(runs)))
    if args.out:
        args.out.write_text(json.dumps([dataclasses.asdict(r) for r in runs], indent=1))


if __name__ == "__main__":
    main()
