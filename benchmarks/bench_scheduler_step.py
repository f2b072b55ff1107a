"""Scheduler-side cost of the connector: vLLM's real Scheduler, 1 / 8 / 256 running requests, 4k prompts.

What is timed: ``Scheduler.schedule()`` and ``Scheduler.update_from_output()`` of each step,
which include every scheduler-role connector hook (lookup, after-alloc, build_connector_meta,
update_connector_output, request_finished). The stand-in model runners and worker-role
connectors run between them untimed (their bytes are not even written: this measures the
engine-core process only). Three engines run the same workload in the same process:

  none     no KV connector (vLLM alone)
  cpu      HiMambaConnector, CPU tier only
  cpu_r0   the same with ``keep_decode_states: false`` (vLLM's state retention unchanged)
  storage  HiMambaConnector, CPU tier + LMCache file store (write-through off: in this
           single process the worker's write threads would otherwise compete for the GIL
           with the timed scheduler, which they never do in a real deployment)

Reported per request count and engine: mean / p50 / p90 scheduler time per step in the prefill
phase (requests being admitted, 4k-token chunks) and in the decode phase (all requests
running), the ratio of each to ``none``, and the connector's own time per step: the wall time
inside its scheduler-role hooks (``CONNECTOR_HOOKS``), measured directly rather than as a
difference of two noisy engines. ``--out`` writes the same as JSON.

Run: ``.venv/bin/python -m benchmarks.bench_scheduler_step --out bench.json``
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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

# Every scheduler-role hook vLLM's Scheduler calls on a connector during serving.
CONNECTOR_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "get_kv_connector_stats",
    "has_pending_block_frees",
    "has_pending_push_work",
    "take_unavailable_requests",
    "update_state_after_free",
    "on_new_request",
)


@dataclasses.dataclass
class PhaseTimes:
    prefill: list[float] = dataclasses.field(default_factory=list)
    decode: list[float] = dataclasses.field(default_factory=list)
    prefill_connector: list[float] = dataclasses.field(default_factory=list)
    decode_connector: list[float] = dataclasses.field(default_factory=list)
    # Collector pauses: inside the step (schedule + update), and inside the connector's hooks.
    prefill_gc: list[float] = dataclasses.field(default_factory=list)
    decode_gc: list[float] = dataclasses.field(default_factory=list)
    prefill_connector_gc: list[float] = dataclasses.field(default_factory=list)
    decode_connector_gc: list[float] = dataclasses.field(default_factory=list)
    prefill_hooks: dict[str, float] = dataclasses.field(default_factory=dict)
    decode_hooks: dict[str, float] = dataclasses.field(default_factory=dict)
    # Steps that scheduled no token: every waiting request waits for a storage probe's answer
    # and the connector blocks (``IDLE_PROBE_WAIT_S``) instead of spinning. Nothing runs that
    # the wait delays, so these are storage latency (``bench_cold_ttft``), not per-step cost.
    idle: list[float] = dataclasses.field(default_factory=list)

    def extend(self, other: PhaseTimes) -> None:
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):
                mine.extend(theirs)
            else:
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0.0) + v

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "idle": {"steps": len(self.idle), "total_ms": 1e3 * sum(self.idle)},
        }
        for name in ("prefill", "decode"):
            xs = getattr(self, name)
            if not xs:
                continue
            q = statistics.quantiles(xs, n=10) if len(xs) >= 10 else [max(xs)] * 9
            conn = getattr(self, f"{name}_connector")
            step_gc = getattr(self, f"{name}_gc")
            conn_gc = getattr(self, f"{name}_connector_gc")
            out[name] = {
                "steps": len(xs),
                "mean_ms": 1e3 * statistics.fmean(xs),
                "p50_ms": 1e3 * statistics.median(xs),
                "p90_ms": 1e3 * q[8],
                "connector_mean_us": 1e6 * statistics.fmean(conn) if conn else 0.0,
                "connector_p50_us": 1e6 * statistics.median(conn) if conn else 0.0,
                # The same without the collector's pauses that fell inside the hooks.
                "connector_net_us": 1e6 * (sum(conn) - sum(conn_gc)) / len(xs),
                "gc_ms_per_step": 1e3 * statistics.fmean(step_gc),
                "mean_net_ms": 1e3 * (sum(xs) - sum(step_gc)) / len(xs),
                # Each hook's time per step of this phase, largest first.
                "connector_hooks_us": {
                    hook: 1e6 * dt / len(xs)
                    for hook, dt in sorted(
                        getattr(self, f"{name}_hooks").items(), key=lambda kv: -kv[1]
                    )
                },
            }
        return out


def timed_scheduler(
    engine: LifecycleEngine, gc_clock: GcClock
) -> tuple[list[float], list[float], list[int]]:
    """Accumulate the wall time of schedule() + update_from_output() per step, the
    collector's pauses inside them, and each step's number of scheduled tokens."""
    sched = engine.scheduler
    per_step: list[float] = []
    gc_s: list[float] = []
    tokens: list[int] = []
    real_schedule, real_update = sched.schedule, sched.update_from_output

    def schedule(*a: Any, **kw: Any) -> Any:
        t, g = time.perf_counter(), gc_clock.total_s
        out = None
        try:
            out = real_schedule(*a, **kw)
            return out
        finally:
            per_step.append(time.perf_counter() - t)
            gc_s.append(gc_clock.total_s - g)
            tokens.append(0 if out is None else out.total_num_scheduled_tokens)

    def update_from_output(*a: Any, **kw: Any) -> Any:
        t, g = time.perf_counter(), gc_clock.total_s
        try:
            return real_update(*a, **kw)
        finally:
            per_step[-1] += time.perf_counter() - t
            gc_s[-1] += gc_clock.total_s - g

    sched.schedule, sched.update_from_output = schedule, update_from_output
    return per_step, gc_s, tokens


class GcClock:
    """Wall time of the collector's pauses (``gc.callbacks``), by generation. A pause lands
    in whatever code allocated last, so a gen-1 pass of 20 ms inside one hook would read as
    that hook's cost; the figures are kept apart so each side is seen for what it is."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.by_gen = [[0, 0.0], [0, 0.0], [0, 0.0]]
        self._t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        self.total_s += dt
        book = self.by_gen[info["generation"]]
        book[0] += 1
        book[1] += dt

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)


class ConnectorClock:
    """Wall time spent inside the scheduler connector's hooks: this step's total and, per
    phase, each hook's total (patched on the instance, so the Scheduler's
    ``self.connector.<hook>(...)`` calls go through it)."""

    def __init__(self, engine: LifecycleEngine, gc_clock: GcClock) -> None:
        self.step_s = 0.0
        self.step_gc_s = 0.0  # of which collector pauses
        self._gc = gc_clock
        self._this_step: dict[str, float] = {}
        self.by_hook: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}, "idle": {}}
        conn = engine.scheduler.connector
        if conn is None:
            return
        for name in CONNECTOR_HOOKS:
            real = getattr(conn, name, None)
            if callable(real):
                setattr(conn, name, self._wrap(name, real))

    def _wrap(self, name: str, real: Any) -> Any:
        def hook(*a: Any, **kw: Any) -> Any:
            t, g = time.perf_counter(), self._gc.total_s
            try:
                return real(*a, **kw)
            finally:
                dt = time.perf_counter() - t
                self.step_gc_s += self._gc.total_s - g
                self.step_s += dt
                self._this_step[name] = self._this_step.get(name, 0.0) + dt

        return hook

    def end_step(self, phase: str) -> tuple[float, float]:
        """(connector time, of which collector pauses) of the step that just ended."""
        total, self.step_s = self.step_s, 0.0
        gc_s, self.step_gc_s = self.step_gc_s, 0.0
        book = self.by_hook[phase]
        for name, dt in self._this_step.items():
            book[name] = book.get(name, 0.0) + dt
        self._this_step.clear()
        return total, gc_s


def run_one(
    name: str, spec: EngineSpec, model_config: Any, args: argparse.Namespace, requests: int
) -> PhaseTimes:
    engine = LifecycleEngine(spec, model_config, verify=False, describe=False, write=False)
    # vLLM's EngineCore freezes its start-up heap (``freeze_gc_heap``) so the collector's oldest
    # generation never rescans it while serving; without this the benchmark's pauses are
    # those of a process vLLM never runs as.
    gc.collect()
    gc.freeze()
    gc_clock = GcClock()
    try:
        for i in range(requests):
            prompt = prompt_of(1000 + i, args.prompt_tokens)
            engine.add_request(f"r{i}", prompt, max_tokens=args.max_tokens)
        per_step, step_gc, tokens = timed_scheduler(engine, gc_clock)
        clock = ConnectorClock(engine, gc_clock)
        times = PhaseTimes()
        decode_steps = 0
        while engine.scheduler.has_requests() and decode_steps < args.decode_steps:
            running = len(engine.scheduler.running)
            all_decoding = running == requests and not any(
                r.is_prefill_chunk for r in engine.scheduler.running
            )
            engine.step()
            if not tokens[-1]:
                times.idle.append(per_step[-1])
                clock.end_step("idle")
                continue
            phase = "decode" if all_decoding else "prefill"
            getattr(times, phase).append(per_step[-1])
            getattr(times, f"{phase}_gc").append(step_gc[-1])
            conn_s, conn_gc_s = clock.end_step(phase)
            getattr(times, f"{phase}_connector").append(conn_s)
            getattr(times, f"{phase}_connector_gc").append(conn_gc_s)
            decode_steps += all_decoding
        if decode_steps < args.decode_steps:
            raise SystemExit(
                f"{name}: only {decode_steps} steps with all {requests} requests decoding;"
                " raise --max-tokens"
            )
        for phase in ("prefill", "decode"):
            book = clock.by_hook[phase]
            hooks = getattr(times, f"{phase}_hooks")
            for hook, dt in book.items():
                hooks[hook] = hooks.get(hook, 0.0) + dt
        return times
    finally:
        gc_clock.close()
        engine.close()
        gc.unfreeze()


def engine_specs(args: argparse.Namespace, requests: int, store: str) -> dict[str, EngineSpec]:
    bs = args.block_size
    max_len = args.prompt_tokens + args.max_tokens + bs
    # Attention blocks for every token of every request, plus 2-3 Mamba blocks each.
    num_blocks = requests * (-(-max_len // bs) + 4) + 64
    base = EngineSpec(
        block_size=bs,
        num_gpu_blocks=num_blocks,
        max_num_seqs=requests,
        max_num_batched_tokens=args.max_batched_tokens,
        max_model_len=max_len,
    )
    return {
        "none": dataclasses.replace(base, with_connector=False),
        "cpu": dataclasses.replace(base, connector_config={"cpu_cache_gb": args.cpu_cache_gb}),
        # vLLM's own retention left alone: separates what the connector's hooks cost from
        # what the denser state retention it sets costs inside vLLM's KV cache manager.
        "cpu_r0": dataclasses.replace(
            base,
            connector_config={"cpu_cache_gb": args.cpu_cache_gb, "keep_decode_states": False},
        ),
        "storage": dataclasses.replace(
            base,
            connector_config={
                "cpu_cache_gb": args.cpu_cache_gb,
                "storage": {"url": f"file://{store}", "write_through": False}
                | ({} if args.probe_wait_ms is None else {"probe_wait_ms": args.probe_wait_ms}),
            },
        ),
    }


def print_table(args: argparse.Namespace, results: dict[str, Any]) -> None:
    print(
        f"scheduler time per step, {args.prompt_tokens}-token prompts, vLLM Scheduler + "
        f"stand-in runner (single process, 1 worker), {args.repeats} interleaved rounds pooled"
    )
    header = (
        f"{'reqs':>5} {'engine':8} {'phase':8} {'steps':>6} {'mean ms':>9} {'p50 ms':>8} "
        f"{'p90 ms':>8} {'x none':>7} {'conn us':>8} {'conn %':>7} {'direct':>7} "
        f"{'net us':>7} {'dir net':>7} {'gc ms':>6}"
    )
    print(header)
    print("-" * len(header))
    for n, per_engine in results.items():
        for name, r in per_engine.items():
            for phase in ("prefill", "decode"):
                p = r[phase]
                share = 100 * p["connector_mean_us"] / (1e3 * p["mean_ms"])
                print(
                    f"{n:>5} {name:8} {phase:8} {p['steps']:6d} {p['mean_ms']:9.3f} "
                    f"{p['p50_ms']:8.3f} {p['p90_ms']:8.3f} {p['x_none']:7.3f} "
                    f"{p['connector_mean_us']:8.1f} {share:6.1f}% {p['direct']:7.3f} "
                    f"{p['connector_net_us']:7.1f} {p['direct_net']:7.3f} "
                    f"{p['gc_ms_per_step']:6.3f}"
                )
                top = list(p["connector_hooks_us"].items())[:3]
                if top:
                    print(" " * 16 + "  ".join(f"{h} {us:.1f}" for h, us in top))
            idle = r["idle"]
            if idle["steps"]:
                print(
                    f"{'':>5} {name:8} {'idle':8} {idle['steps']:6d} steps scheduled nothing"
                    f" (waiting for storage answers): {idle['total_ms']:.1f} ms in all"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", default="1,8,256", help="comma-separated running-request counts")
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
    ap.add_argument(
        "--probe-wait-ms",
        type=float,
        help="the storage engine's probe_wait_ms (default: the connector's default)",
    )
    ap.add_argument("--out", type=Path, help="write results as JSON here")
    args = ap.parse_args()
    logging.getLogger("vllm").setLevel(logging.ERROR)
    logging.getLogger("himamba").setLevel(logging.ERROR)

    counts = [int(x) for x in args.requests.split(",")]
    max_len = args.prompt_tokens + args.max_tokens + args.block_size
    store = tempfile.mkdtemp(prefix="himamba-bench-store-")
    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="himamba-bench-model-")))
    model_config = make_model_config(model_dir, max_len)
    results: dict[str, Any] = {}
    for n in counts:
        configs = engine_specs(args, n, store)
        pooled = {name: PhaseTimes() for name in configs}
        wall = dict.fromkeys(configs, 0.0)
        for _ in range(args.repeats):  # interleaved, so machine drift hits every engine alike
            for name, spec in configs.items():
                t0 = time.perf_counter()
                pooled[name].extend(run_one(name, spec, model_config, args, n))
                wall[name] += time.perf_counter() - t0
        per_engine = {name: pooled[name].summary() | {"wall_s": wall[name]} for name in configs}
        for r in per_engine.values():
            for phase in ("prefill", "decode"):
                p, none = r[phase], per_engine["none"][phase]
                p["x_none"] = p["mean_ms"] / none["mean_ms"]
                # 1 + the connector's own time over vLLM alone's step: the stable figure.
                p["direct"] = 1 + p["connector_mean_us"] / (1e3 * none["mean_ms"])
                p["direct_net"] = 1 + p["connector_net_us"] / (1e3 * none["mean_net_ms"])
        results[str(n)] = per_engine
    print_table(args, results)
    if args.out:
        payload = {"params": vars(args) | {"out": str(args.out)}, "results": results}
        args.out.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
