"""Engine-loop stalls while storage is attached at run time (``weights_fingerprint: full``).

An offline engine as users run it (``vllm.LLM`` with its engine core and worker in processes of
their own, so a ``collective_rpc`` runs on the engine loop, between two steps) serves a batch of
long generations on the tests' tiny hybrid model; this script steps it one output at a time and
times each step by wall clock. After ``--warmup`` steps another thread attaches a storage
directory with ``weights_fingerprint: full`` through ``collective_rpc("himamba_control")``, then
polls ``status`` until the workers and the scheduler half both use it. The checkpoint folder is
a copy of the tiny model plus ``--pad-mb`` of extra weights in a subfolder (vLLM does not load
it; the full fingerprint reads every byte of it), so attaching costs what it would on a large
model. ``--start-with-storage`` starts with another store attached (a switch: LMCache is then
loaded already).

Reported (one JSON line):

* steps: the median before the attach, the longest and the 99th percentile while it ran (from
  the call until both halves use the new store, plus ``--tail`` steps), the longest over the
  median (goal: <= 2), and how many steps took more than twice the median, before and during;
* ``hook_max_*``: the longest single himamba hook or control call on the engine's loops (timed
  inside the engine processes): the connector's own share of a step, which on a machine shared
  with other work is the part a step's wall time does not isolate;
* how long the attach took (workers live, scheduler half live) and the control calls' latency.

    python -m benchmarks.bench_control_attach               # 1 GiB of padding
    python -m benchmarks.bench_control_attach --pad-mb 256 --start-with-storage
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# The engine core in its own process: the control call then runs on its loop, between steps,
# as on a server.
# The harness's other CPU-engine defaults are set when it is imported (before vLLM is).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
import tests.harness.offline_engine  # noqa: E402, F401

# -- inside the engine's processes ------------------------------------------------------------
# How long each himamba hook and control call held its process's loop, appended as
# "<wall clock at the end> <seconds> <name>" lines to HIMAMBA_BENCH_HOOK_LOG.<pid> (the engine
# core runs the scheduler hooks, a worker process the worker hooks and the control call): the
# connector's own share of each step, which step wall times on a shared machine are not.
TIMED_HOOKS = (
    "update_connector_output", "build_connector_meta", "build_connector_worker_meta",
    "start_load_kv", "wait_for_save", "get_transfer_results", "handle_preemptions", "control",
)  # fmt: skip


def _time_hooks(log_prefix: str) -> None:
    from himamba.connector.vllm_connector import HiMambaConnector

    log = open(f"{log_prefix}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115 - process-long
    for name in TIMED_HOOKS:
        real = getattr(HiMambaConnector, name)
        if getattr(real, "_bench_timed", False):
            continue

        def timed(self: Any, *a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _real(self, *a, **k)
            finally:
                log.write(f"{time.time()} {time.perf_counter() - t} {_name}\n")

        timed._bench_timed = True  # type: ignore[attr-defined]
        setattr(HiMambaConnector, name, timed)


# vLLM starts its engine processes with "spawn": each imports this script as __mp_main__.
if os.environ.get("HIMAMBA_BENCH_HOOK_LOG"):
    _time_hooks(os.environ["HIMAMBA_BENCH_HOOK_LOG"])


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def read_hook_log(prefix: Path) -> list[tuple[float, float, str]]:
    out = []
    for f in prefix.parent.glob(prefix.name + ".*"):
        for line in f.read_text().splitlines():
            t, d, name = line.split()
            out.append((float(t), float(d), name))
    return out


# -- the benchmark -----------------------------------------------------------------------------
def padded_model(src: Path, dst: Path, pad_mb: int) -> Path:
    """A copy of ``src`` with ``pad_mb`` of random bytes in ``padding/`` (never loaded by vLLM,
    which reads only the top folder's weight files; hashed by the full fingerprint)."""
    import numpy as np
    from safetensors.numpy import save_file

    shutil.copytree(src, dst)
    (dst / "padding").mkdir()
    rng = np.random.default_rng(0)
    chunk = 64  # MiB per tensor
    tensors = {
        f"pad.{i}": rng.integers(
            0, 255, size=(min(chunk, pad_mb - i * chunk) << 20,), dtype=np.uint8
        )
        for i in range((pad_mb + chunk - 1) // chunk)
    }
    save_file(tensors, str(dst / "padding" / "pad.safetensors"))
    return dst


class Controller(threading.Thread):
    """Attaches storage through collective_rpc, then polls status until both halves use it."""

    def __init__(self, llm: Any, section: dict[str, Any], poll_s: float) -> None:
        super().__init__(daemon=True)
        self.llm, self.section, self.poll_s = llm, section, poll_s
        self.started = self.worker_live = self.done = 0.0
        self.calls: list[tuple[str, float]] = []
        self.timeline: list[tuple[float, float, str]] = []
        self.answers: list[Any] = []
        self.error: str | None = None

    def rpc(self, *args: Any) -> list[dict[str, Any]]:
        t = time.perf_counter()
        out = self.llm.collective_rpc("himamba_control", args=args)
        self.calls.append((args[0], time.perf_counter() - t))
        self.timeline.append((t, time.perf_counter() - t, args[0]))
        self.answers.append(out)
        return out

    def run(self) -> None:
        try:
            self.started = time.perf_counter()
            answer = self.rpc("attach_storage", self.section)
            while True:
                if all(r["storage"] == "attached" for r in answer) and not self.worker_live:
                    self.worker_live = time.perf_counter()
                if self.worker_live and all(r.get("scheduler", "attached") == "attached"
                                            for r in answer):  # fmt: skip
                    break
                time.sleep(self.poll_s)
                answer = self.rpc("status")
            self.done = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - reported in the result
            self.error = repr(exc)
            self.done = time.perf_counter()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from tests.harness.offline_engine import prompt
    from tests.harness.tiny_models import DEFAULT_CACHE_DIR, build_granite_hybrid

    tmp = Path(tempfile.mkdtemp(prefix="bench-control-"))
    hook_log = tmp / "hooks"
    os.environ["HIMAMBA_BENCH_HOOK_LOG"] = str(hook_log)
    try:
        model = padded_model(build_granite_hybrid(DEFAULT_CACHE_DIR), tmp / "model", args.pad_mb)
        store = tmp / "store"
        store.mkdir()
        extra: dict[str, Any] = {"cpu_cache_gb": 0.05}
        if args.start_with_storage:  # LMCache is then loaded already: only the switch is timed
            (tmp / "first").mkdir()
            extra["storage"] = {"url": f"file://{tmp / 'first'}"}
        llm = LLM(
            model=str(model),
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=2048,
            max_num_seqs=args.requests,
            enable_prefix_caching=True,
            seed=0,
            worker_extension_cls="himamba.connector.control.HiMambaWorkerExtension",
            kv_transfer_config=KVTransferConfig(
                kv_connector="HiMambaConnector",
                kv_connector_module_path="himamba.connector",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            ),
        )
        engine = llm.llm_engine
        sp = SamplingParams(
            temperature=0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False
        )
        for i in range(args.requests):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt(900 + i, 300)}, sp)
        section = {"url": f"file://{store}", "weights_fingerprint": "full"}
        ctl = Controller(llm, section, args.poll_s)
        steps: list[tuple[float, float]] = []  # (start, duration)
        tail_left = None
        while engine.has_unfinished_requests():
            if len(steps) == args.warmup:
                ctl.start()
            t = time.perf_counter()
            engine.step()
            steps.append((t, time.perf_counter() - t))
            if ctl.done and tail_left is None:
                tail_left = args.tail
            if tail_left is not None:
                tail_left -= 1
                if tail_left <= 0:
                    break
        ctl.join(timeout=60)
        hooks = read_hook_log(hook_log)
        wall0 = time.time() - time.perf_counter()  # perf_counter -> wall clock, this process
        start, end = ctl.started + wall0, (ctl.done or time.perf_counter()) + wall0
        during_hooks = [(d, n) for t, d, n in hooks if start <= t <= end]
        before_hooks = [d for t, d, n in hooks if t < start]
        before = [d for t, d in steps[5 : args.warmup]]  # the first steps include prefill
        end = ctl.done or float("inf")
        during = [d for t, d in steps if ctl.started <= t + d and t <= end]
        if tail_left is not None:
            during += [d for t, d in steps if t > end]
        median = statistics.median(before)
        result = {
            "pad_mb": args.pad_mb,
            "start_with_storage": args.start_with_storage,
            "requests": args.requests,
            "steps": len(steps),
            "steps_before_attach": len(before),
            "median_step_ms": round(median * 1000, 2),
            "max_step_before_ms": round(max(before) * 1000, 2),
            "max_step_during_attach_ms": round(max(during) * 1000, 2) if during else None,
            "ratio_max_during_to_median": round(max(during) / median, 2) if during else None,
            "steps_during_attach": len(during),
            "p99_step_during_attach_ms": round(_pct(during, 0.99) * 1000, 2) if during else None,
            "steps_over_2x_median": {
                "before": sum(d > 2 * median for d in before),
                "during": sum(d > 2 * median for d in during),
            },
            "attach_worker_live_s": round(ctl.worker_live - ctl.started, 3)
            if ctl.worker_live
            else None,
            "attach_total_s": round(ctl.done - ctl.started, 3) if ctl.done else None,
            "rpc_ms": {
                "attach": [round(s * 1000, 1) for a, s in ctl.calls if a == "attach_storage"],
                "status_max": round(
                    max([s for a, s in ctl.calls if a == "status"] or [0]) * 1000, 1
                ),
            },
            "last_status": ctl.answers[-1] if ctl.answers else None,
            "error": ctl.error,
            "objects_written": sum(1 for p in store.rglob("*@0@*.data")),
            # The connector's own time on the engine loop: longest single hook or control call.
            "hook_calls_timed": len(hooks),
            "hook_max_before_ms": round(max(before_hooks, default=0) * 1000, 2),
            "hook_max_during_attach_ms": round(max(during_hooks, default=(0, ""))[0] * 1000, 2),
            "hook_max_during_attach_is": max(during_hooks, default=(0, ""))[1],
        }
        if args.verbose:  # the slow steps and every control call, in seconds from the attach
            slow = [(t, d, "step") for t, d in steps if d > 3 * median]
            result["timeline"] = [
                (round(t - ctl.started, 3), round(d * 1000, 1), what)
                for t, d, what in sorted(slow + ctl.timeline)
                if t >= ctl.started - 1
            ]
        llm.llm_engine.engine_core.shutdown()
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pad-mb", type=int, default=1024, help="extra checkpoint bytes to hash")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=100, help="steps before the attach")
    ap.add_argument("--tail", type=int, default=20, help="steps measured after the attach")
    ap.add_argument("--poll-s", type=float, default=0.5, help="status polling period")
    ap.add_argument("--verbose", action="store_true", help="add the timeline of slow steps")
    ap.add_argument(
        "--start-with-storage",
        action="store_true",
        help="start with another store attached (a switch, not a first attach)",
    )
    args = ap.parse_args()
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
