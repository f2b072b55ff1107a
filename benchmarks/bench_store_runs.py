"""The tree's share of a prefill step: reserve, then commit, the store runs of admitted prompts.

What the scheduler does per step while prompts are admitted (``HostStores._plan_kv`` and
``_plan_mamba``, then the plan's ``complete_store``), on the tree alone, without vLLM: each of N
requests stores its B-block prompt in chunks of C blocks, one ``reserve_kv_run`` and one
Mamba state at each chunk end per chunk (or, with ``--state-every K``, at every K-th chunk end and
the prompt end only, as the state budget skips the rest: the next run then grows the stateless
leaf in place), committed like a step plan. Reported: microseconds per
run (one chunk of one request, state included) and per stored block, best of ``--reps``. The
engine-level figure is ``bench_scheduler_step``; this isolates the tree part of it, whose
run-to-run noise is far smaller, so two versions can be compared (run it in each).

    python -m benchmarks.bench_store_runs            # ~5 s
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from typing import Any

from himamba.connector.tree import HybridRadixTree

try:
    from himamba.connector.tree import StoreCursor
except ImportError:  # a version before cursors (run in a worktree of it to compare)
    StoreCursor = None  # type: ignore[assignment,misc]


def chain(n: int, salt: str) -> list[bytes]:
    """A request's chained block hashes (distinct prompts: every request its own path)."""
    out, h = [], salt.encode()
    for i in range(n):
        h = hashlib.blake2b(h + i.to_bytes(4, "little"), digest_size=16).digest()
        out.append(h)
    return out


def one_rep(requests: int, blocks: int, chunk: int, every: int = 1) -> tuple[float, int, int]:
    tree = HybridRadixTree(requests * blocks + 1, requests * (blocks // chunk + 1) + 1)
    prompts = [chain(blocks, f"r{i}") for i in range(requests)]
    runs = stored = 0
    t = time.perf_counter()
    for hashes in prompts:
        cursor = StoreCursor() if StoreCursor is not None else None
        for k, start in enumerate(range(0, blocks, chunk)):
            end = min(start + chunk, blocks)
            keep = (k + 1) % every == 0 or end == blocks
            state = None
            if cursor is not None:  # what the scheduler passes: the request's own cursor
                run = tree.reserve_kv_run(hashes, None, start, end, True, cursor=cursor)
                if keep:
                    state = tree.reserve_mamba(hashes, None, end, cursor=cursor)
            else:  # a version before cursors
                try:
                    run = tree.reserve_kv_run(hashes, None, start, end, commit_settles=True)
                except TypeError:  # a version without the option
                    run = tree.reserve_kv_run(hashes, None, start, end)
                if keep:
                    state = tree.reserve_mamba(hashes, None, end)
            tree.complete_store([s for _, s in run], [] if state is None else [state])
            runs += 1
            stored += len(run)
    return time.perf_counter() - t, runs, stored


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=32, help="prompt blocks (4k tokens at 128)")
    ap.add_argument("--chunk", type=int, default=16, help="blocks per prefill chunk")
    ap.add_argument(
        "--state-every", type=int, default=1, help="a state at every K-th chunk end (and the last)"
    )
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    best = min(
        one_rep(args.requests, args.blocks, args.chunk, args.state_every) for _ in range(args.reps)
    )
    dt, runs, stored = best
    out: dict[str, Any] = {
        "params": vars(args),
        "us_per_run": round(1e6 * dt / runs, 2),
        "us_per_block": round(1e6 * dt / stored, 3),
        "runs": runs,
        "blocks": stored,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
