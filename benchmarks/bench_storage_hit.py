"""Time to serve a prompt whose first N tokens come from the storage tier, vs recompute, vs CPU tier.

Two engines with the HiMamba connector run side by side (one subprocess each), identical but for
the storage backend: a local directory (``file:///...``, LMCache ``fs_native``) and a
redis-server this script starts on 127.0.0.1 (``redis://...``, LMCache ``resp``). Per rep, on
each engine, a fresh random prompt of N + one block tokens, ``max_tokens`` (default 1), float32:

* ``recompute``: the first ``generate`` (nothing cached anywhere; the connector probes storage,
  misses, computes everything, stores into its CPU tier and writes through to storage),
* ``flush``: the worker's ``storage.flush()`` waits until the write-through has landed (timed,
  not part of any request),
* ``cpu_hit``: ``llm.reset_prefix_cache()`` (vLLM's device cache only), then the same prompt: the
  first N tokens are loaded from the CPU tier (after the storage probe every new request makes),
* ``storage_hit``: ``llm.reset_prefix_cache()`` and the connector's ``drop_host_tier()`` (device
  cache and CPU tier dropped, storage kept), then the same prompt: the connector probes storage (``exists``), prefetches the N/bs
  KV blocks and the Mamba state at N into host slots, then loads them like a CPU-tier hit. While
  the probe and the prefetch are in flight it answers vLLM "ask again", so the wall time counts
  those scheduler round trips: it is the latency a user sees,
* ``storage_hit_evicted`` (``fs`` only, unless ``--no-evict``): once more after dropping the
  objects' pages from the OS page cache (``fsync`` + ``posix_fadvise(DONTNEED)`` on this run's
  files only), so the reads go to the (virtual) disk.

Every hit is checked: ``num_cached_tokens == N``, the output tokens equal the recompute's, and
for storage hits the worker fetched N/bs + 1 objects. The parent alternates engine order per rep
so background load on a shared box hits both alike. Output: one JSON line per (model, backend,
N), then a summary line with the ratios.

    python -m benchmarks.bench_storage_hit            # "big" model (~90 M params), N = 1024, 4096, 5 reps
    python -m benchmarks.bench_storage_hit --quick    # the tests' tiny model, 3 reps
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from benchmarks.bench_cpu_tier import BENCH_MODELS, MAX_MODEL_LEN, ChildEngine, build_model  # noqa: E402

CELLS = ("recompute", "cpu_hit", "storage_hit", "storage_hit_evicted")


# -- one engine (child process) -----------------------------------------------------------
def evict_page_cache(root: str) -> int:
    """Drop this store's files from the page cache (needs them clean: fsync first)."""
    n = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def serve_engine(args: dict[str, Any]) -> None:
    from tests.harness.offline_engine import close_llm, connectors, generate, make_llm, prompt

    if args.get("switch_interval"):
        sys.setswitchinterval(args["switch_interval"])  # diagnostic: GIL hand-off latency
    extra = {"cpu_cache_gb": args["cpu_cache_gb"], "storage": {"url": args["url"]}}
    t0 = time.perf_counter()
    llm = make_llm(
        {"model": args["model"], "dtype": "float32", "max_model_len": MAX_MODEL_LEN}, extra
    )
    start_s = time.perf_counter() - t0
    sched, worker = connectors(llm)
    storage = worker.worker.storage
    assert storage is not None, "storage tier did not open"
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    mt = args["max_tokens"]

    # Count the connector's answers to vLLM (benchmark-side wrapper, connector untouched):
    # None = "ask again" while a storage probe or prefetch is in flight.
    answers: list[tuple[float, Any]] = []
    orig_lookup = sched.get_num_new_matched_tokens

    def lookup(request: Any, num_computed_tokens: int) -> Any:
        res = orig_lookup(request, num_computed_tokens)
        answers.append((time.perf_counter(), res[0]))
        return res

    sched.get_num_new_matched_tokens = lookup  # type: ignore[method-assign]
    # When the prefetch is submitted: splits the wait into probe (exists) and fetch (get).
    fetch_marks: list[float] = []
    planner = sched.scheduler.storage
    orig_start_fetch = planner._start_fetch

    def start_fetch(*a: Any, **kw: Any) -> bool:
        ok = orig_start_fetch(*a, **kw)
        fetch_marks.append(time.perf_counter())
        return ok

    planner._start_fetch = start_fetch  # type: ignore[method-assign]

    def drop_host_tier() -> None:
        llm.reset_prefix_cache()
        sched.drop_host_tier()

    def counters() -> dict[str, float]:
        return {**worker.stats(), **{f"sched_{k}": v for k, v in sched.stats().items()}}

    def timed(p: list[int]) -> dict[str, Any]:
        answers.clear()
        fetch_marks.clear()
        c0 = counters()
        out = generate(llm, [p], mt)[0]
        c1 = counters()
        t_first = answers[0][0] if answers else None
        t_answer = next((t for t, r in answers if r is not None), None)
        return {
            "s": out["s"],
            "cached": out["cached"],
            "tokens": out["tokens"],
            "ask_again": sum(1 for _, r in answers if r is None),
            # From the first lookup to the connector's final answer (probe + prefetch wait).
            "wait_s": None if t_first is None or t_answer is None else t_answer - t_first,
            "probe_s": fetch_marks[0] - t_first if fetch_marks and t_first else None,
            "fetch_s": t_answer - fetch_marks[0] if fetch_marks and t_answer else None,
            "delta": {
                k: round(v - c0.get(k, 0), 4)
                for k, v in c1.items()
                if isinstance(v, (int, float)) and v != c0.get(k, 0)
            },
        }

    def one(p: list[int], evict: bool) -> dict[str, Any]:
        row: dict[str, Any] = {}
        row["recompute"] = timed(p)
        c0, t = counters(), time.perf_counter()
        row["flushed"] = worker.worker.flush_storage(120.0)
        row["flush_s"] = time.perf_counter() - t
        c1 = counters()
        row["flush_delta"] = {
            k: round(v - c0.get(k, 0), 4) for k, v in c1.items() if v != c0.get(k)
        }
        llm.reset_prefix_cache()
        row["cpu_hit"] = timed(p)
        drop_host_tier()
        row["storage_hit"] = timed(p)
        if evict:
            row["evicted_files"] = evict_page_cache(args["fs_root"])
            drop_host_tier()
            row["storage_hit_evicted"] = timed(p)
        drop_host_tier()
        return row

    evict = bool(args.get("fs_root")) and args["evict"]
    # Warm-up (not timed): first-call costs, and the longest prompt once for page faults.
    for seed, n in ((999_001, 2 * bs + 7), (999_002, max(args["sizes"]) + bs)):
        one(prompt(seed, n), evict)
    reply({"ready": True, "engine_start_s": start_s, "block_size": bs})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "run":
            reply(one(prompt(cmd["seed"], cmd["len"]), evict))
        elif cmd["cmd"] == "close":
            stats = {"scheduler": sched.stats(), "worker": worker.stats()}
            close_llm(llm)
            reply({"stats": stats})
            return


def reply(obj: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


class Engine(ChildEngine):
    def __init__(self, name: str, args: dict[str, Any]) -> None:
        self.name = name
        log = BENCH_MODELS / f"engine-storage-{name}.log"
        super().__init__(name, "benchmarks.bench_storage_hit", args, log)


# -- parent --------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def summarize(model: str, backend: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for n in sorted({r["n"] for r in rows}):
        rs = [r for r in rows if r["n"] == n]
        bs = rs[0]["block_size"]
        cells = [c for c in CELLS if c in rs[0]]
        line: dict[str, Any] = {
            "model": model,
            "backend": backend,
            "n_hit_tokens": n,
            "block_size": bs,
            "prompt_tokens": rs[0]["len"],
            "reps": len(rs),
        }
        for c in cells:
            line[f"{c}_s_median"] = med([r[c]["s"] for r in rs])
        for c in cells:
            line[f"{c}_s_all"] = [round(r[c]["s"], 4) for r in rs]
        rec = line["recompute_s_median"]
        line["ratio_recompute_over_storage_hit"] = round(rec / line["storage_hit_s_median"], 2)
        line["ratio_recompute_over_cpu_hit"] = round(rec / line["cpu_hit_s_median"], 2)
        line["ratio_storage_hit_over_cpu_hit"] = round(
            line["storage_hit_s_median"] / line["cpu_hit_s_median"], 2
        )
        # Per-rep ratios (same prompt, back to back) are less exposed to drifting load.
        line["ratio_storage_over_cpu_per_rep_median"] = med(
            [r["storage_hit"]["s"] / r["cpu_hit"]["s"] for r in rs]
        )
        if "storage_hit_evicted" in cells:
            line["ratio_recompute_over_storage_hit_evicted"] = round(
                rec / line["storage_hit_evicted_s_median"], 2
            )
        for c in cells:
            line[f"{c}_wait_s_median"] = med([r[c]["wait_s"] or 0.0 for r in rs])
            line[f"{c}_ask_again_median"] = med([r[c]["ask_again"] for r in rs])
        for c in cells:
            line[f"{c}_wait_s_all"] = [round(r[c]["wait_s"] or 0.0, 4) for r in rs]
        for c in cells:
            if c.startswith("storage"):
                line[f"{c}_probe_s_median"] = med([r[c]["probe_s"] or 0.0 for r in rs])
                line[f"{c}_fetch_s_median"] = med([r[c]["fetch_s"] or 0.0 for r in rs])
        # The storage tier's own share of the latency: its wait beyond a CPU hit's probe wait.
        line["storage_extra_wait_s_median"] = med(
            [(r["storage_hit"]["wait_s"] or 0.0) - (r["cpu_hit"]["wait_s"] or 0.0) for r in rs]
        )
        line["storage_hit_load_s_median"] = med(
            [r["storage_hit"]["delta"].get("load_seconds", 0.0) for r in rs]
        )
        line["cpu_hit_load_s_median"] = med(
            [r["cpu_hit"]["delta"].get("load_seconds", 0.0) for r in rs]
        )
        line["flush_s_median"] = med([r["flush_s"] for r in rs])
        line["storage_bytes_read_per_hit"] = rs[0]["storage_hit"]["delta"].get(
            "storage_bytes_read", 0
        )
        hits = [c for c in cells if c != "recompute"]
        expect_gets = n // bs + 1  # N/bs KV blocks + the Mamba state at N
        line["all_hits_exact"] = all(r[c]["cached"] == n for r in rs for c in hits)
        line["cached_tokens_seen"] = {c: sorted({r[c]["cached"] for r in rs}) for c in hits}
        line["all_tokens_identical"] = all(
            r[c]["tokens"] == r["recompute"]["tokens"] for r in rs for c in hits
        )
        line["recompute_cached_zero"] = all(r["recompute"]["cached"] == 0 for r in rs)
        line["storage_hits_fetched_all"] = all(
            r[c]["delta"].get("storage_gets_ok", 0) == expect_gets
            and r[c]["delta"].get("sched_storage_fetches", 0) == 1
            for r in rs
            for c in hits
            if c.startswith("storage")
        )
        line["cpu_hits_no_fetch"] = all(
            r["cpu_hit"]["delta"].get("storage_gets_ok", 0) == 0 for r in rs
        )
        line["all_flushed"] = all(r["flushed"] for r in rs)
        line["load_avg_1min_range"] = [
            round(min(r["load1"] for r in rs), 2),
            round(max(r["load1"] for r in rs), 2),
        ]
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model only, 3 reps")
    ap.add_argument("--models", default=None, help="comma list of tiny,big (default big)")
    ap.add_argument("--backends", default="fs,redis", help="comma list of fs,redis")
    ap.add_argument("--sizes", default="1024,4096", help="hit sizes N in tokens (x block)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--cpu-cache-gb", type=float, default=1.0)
    ap.add_argument("--no-evict", action="store_true", help="skip the page-cache-evicted fs cell")
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval() in the engines (diagnostic; Python's default is 0.005 s)",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.child is not None:
        serve_engine(json.loads(a.child))
        return

    models = (a.models or ("tiny" if a.quick else "big")).split(",")
    backends = a.backends.split(",")
    reps = a.reps or (3 if a.quick else 5)
    sizes = [int(s) for s in a.sizes.split(",")]
    BENCH_MODELS.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="storage-hit-", dir=BENCH_MODELS))
    redis = None
    lines: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    engines: dict[str, Engine] = {}
    try:
        if "redis" in backends:
            from tests.harness.redis_server import RedisServer

            (work / "redis").mkdir()
            redis = RedisServer(work / "redis")
            redis.start()
        for kind in models:
            t = time.perf_counter()
            path = build_model(kind)
            build_s = time.perf_counter() - t
            common = {
                "model": str(path),
                "sizes": sizes,
                "max_tokens": a.max_tokens,
                "cpu_cache_gb": a.cpu_cache_gb,
                "evict": not a.no_evict,
                "switch_interval": a.switch_interval,
            }
            for b in backends:
                if b == "fs":
                    root = work / f"fs-{kind}"
                    root.mkdir()
                    args = {**common, "url": f"file://{root}", "fs_root": str(root)}
                elif b == "redis":
                    assert redis is not None
                    args = {**common, "url": redis.url, "fs_root": None}
                else:
                    raise SystemExit(f"unknown backend {b}")
                engines[b] = Engine(f"{kind}-{b}", args)
            ready = {b: e.wait() for b, e in engines.items()}
            bs = next(iter(ready.values()))["block_size"]
            if any(n % bs for n in sizes):
                raise SystemExit(f"{kind}: block size {bs}; --sizes must be multiples of it")
            rows: dict[str, list[dict[str, Any]]] = {b: [] for b in engines}
            order = list(engines)
            for n in sizes:
                for rep in range(reps):
                    cmd = {"cmd": "run", "seed": 7_000 * n + rep, "len": n + bs}
                    for b in order if rep % 2 == 0 else order[::-1]:
                        row = {"n": n, "rep": rep, "len": cmd["len"], "block_size": bs}
                        row["load1"] = os.getloadavg()[0]
                        row.update(engines[b].send(cmd))
                        rows[b].append(row)
                        print(
                            json.dumps(
                                {
                                    "progress": f"{kind}/{b}/N={n}/rep={rep}",
                                    **{c: round(row[c]["s"], 3) for c in CELLS if c in row},
                                }
                            ),
                            file=sys.stderr,
                            flush=True,
                        )
            closed = {b: e.close() for b, e in engines.items()}
            engines.clear()
            info[kind] = {
                "model_build_s": round(build_s, 2),
                "engine_start_s": {b: round(r["engine_start_s"], 2) for b, r in ready.items()},
                "final_stats": closed,
            }
            for b, rs in rows.items():
                for line in summarize(kind, b, rs):
                    print(json.dumps(line), flush=True)
                    lines.append(line)
    finally:
        for e in engines.values():
            e.kill()
        if redis is not None:
            redis.kill()
        shutil.rmtree(work, ignore_errors=True)

    def key(x: dict[str, Any]) -> str:
        return f"{x['model']}/{x['backend']}/N={x['n_hit_tokens']}"

    summary = {
        "summary": True,
        "max_tokens": a.max_tokens,
        "cpu_cache_gb": a.cpu_cache_gb,
        "recompute_over_storage_hit": {
            key(x): x["ratio_recompute_over_storage_hit"] for x in lines
        },
        "recompute_over_cpu_hit": {key(x): x["ratio_recompute_over_cpu_hit"] for x in lines},
        "storage_hit_over_cpu_hit": {key(x): x["ratio_storage_hit_over_cpu_hit"] for x in lines},
        "recompute_over_storage_hit_evicted": {
            key(x): x["ratio_recompute_over_storage_hit_evicted"]
            for x in lines
            if "ratio_recompute_over_storage_hit_evicted" in x
        },
        "all_exact": all(
            x["all_hits_exact"]
            and x["all_tokens_identical"]
            and x["storage_hits_fetched_all"]
            and x["recompute_cached_zero"]
            and x["all_flushed"]
            for x in lines
        ),
        "engines": info,
        "load_avg_start": [round(v, 2) for v in load_start],
        "load_avg_end": [round(v, 2) for v in os.getloadavg()],
        "nproc": os.cpu_count(),
        "wall_s": round(time.perf_counter() - t_all, 1),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
