"""Benchmark the hybrid radix tree on a chat-shaped trace; compare with vLLM's offload index.

Trace: conversations that share a few system prompts, grow by turns (a Mamba state at every
turn end) and sometimes branch from another conversation's turn (regenerate / edit). The
tree is filled with write-through stores until it caches ``--blocks`` host KV blocks, then
timed on matches (a known conversation plus one new turn, half with the system prompt as
vLLM's own GPU hit), evictions, and against vLLM's ``CPUOffloadingManager`` (LRU) answering
the same prefix queries block by block, which is how vLLM's offloading connector looks up.

    python benchmarks/bench_tree.py --blocks 100000 --json
"""

from __future__ import annotations

import argparse
import array
import gc
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Sequence

from himamba.connector.tree import HybridRadixTree
from tests.unit.tree.tree_helpers import evict_host, evict_host_mamba

SYS_BLOCKS, TURN_BLOCKS, MAX_TURNS = 16, 4, 8


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def pct(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6


def make_trace(n_blocks: int, rng: random.Random) -> tuple[list[list[bytes]], list[int]]:
    """Conversations as chained block hashes; returns them and their turn boundaries."""
    n_sys = max(4, n_blocks // 20_000)
    systems = []
    for s in range(n_sys):
        prev, hs = b"sys%d" % s, []
        for _ in range(SYS_BLOCKS):
            prev = hashlib.blake2b(prev, digest_size=32).digest()
            hs.append(prev)
        systems.append(hs)
    convs: list[list[bytes]] = []
    total = n_sys * SYS_BLOCKS
    while total < n_blocks:
        if convs and rng.random() < 0.25:  # branch off an existing conversation's turn
            base = rng.choice(convs)
            cut = SYS_BLOCKS + TURN_BLOCKS * rng.randrange((len(base) - SYS_BLOCKS) // TURN_BLOCKS)
            hs = base[:cut]
        else:
            hs = list(rng.choice(systems))
        for _ in range(rng.randint(1, MAX_TURNS)):
            prev = hs[-1]
            for _ in range(TURN_BLOCKS):
                prev = hashlib.blake2b(prev + os.urandom(4), digest_size=32).digest()
                hs.append(prev)
                total += 1
        convs.append(hs)
    return convs, [n_sys * SYS_BLOCKS]


def build_tree(
    convs: list[list[bytes]], capacity: int, max_nodes: int | None = None
) -> tuple[HybridRadixTree, array.array]:
    """The tree and the insert times, as raw doubles: a list of float objects (~32 bytes a
    store, ~65 a block) would be counted as the tree's memory by ``main``."""
    tree = HybridRadixTree(capacity, capacity // TURN_BLOCKS + 1024, max_nodes=max_nodes)
    times = array.array("d")
    clock = time.perf_counter
    for hs in convs:
        for end in range(SYS_BLOCKS, len(hs) + 1, TURN_BLOCKS):
            kv = []
            for i in range(max(0, end - TURN_BLOCKS if end > SYS_BLOCKS else 0), end):
                t0 = clock()
                s = tree.reserve_kv(hs, None, i)
                times.append(clock() - t0)
                if s is not None:
                    kv.append(s)
            m = tree.reserve_mamba(hs, None, end)
            tree.complete_store(kv, [m] if m is not None else [])
    return tree, times


def vllm_index(convs: list[list[bytes]], capacity: int):  # type: ignore[no-untyped-def]
    """vLLM's CPU offloading manager filled with the same blocks (KV only: no Mamba notion)."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    mgr = CPUOffloadingManager(num_chunks=capacity)
    for r, hs in enumerate(convs):
        ctx = ReqContext(req_id=str(r))
        keys = [make_offload_key(h, 0) for h in hs]
        out = mgr.prepare_store(keys, ctx)
        if out is not None:
            mgr.complete_store(out.keys_to_store, ctx)
    return mgr, ReqContext, make_offload_key


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-nodes", type=int, default=None, help="node budget (default: none)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    convs, _ = make_trace(args.blocks, rng)
    capacity = args.blocks + 1024
    gc.collect()
    rss0 = rss_mb()
    t0 = time.perf_counter()
    tree, ins = build_tree(convs, capacity, args.max_nodes)
    build_s = time.perf_counter() - t0
    gc.collect()
    rss1 = rss_mb() - ins.buffer_info()[1] * ins.itemsize / 2**20  # the tree, not its timings
    # The hash objects the tree keeps alive: shared with the trace here (so not in the RSS
    # above), but in a server vLLM frees a finished request's hashes and the tree's stay.
    keys = {id(h): sys.getsizeof(h) for x in tree.iter_nodes() for h in x.hashes}
    key_bytes = sum(keys.values())
    del keys
    queries = []
    for _ in range(args.queries):
        hs = rng.choice(convs)
        turns = (len(hs) - SYS_BLOCKS) // TURN_BLOCKS
        end = SYS_BLOCKS + TURN_BLOCKS * rng.randint(0, turns)
        q = hs[:end] + [hashlib.blake2b(hs[end - 1] + b"new", digest_size=32).digest()]
        queries.append((q, SYS_BLOCKS if rng.random() < 0.5 else 0))
    clock = time.perf_counter
    mt, hit_blocks = [], 0
    for q, start in queries:
        t = clock()
        r = tree.match(q, None, start)
        mt.append(clock() - t)
        hit_blocks += r.num_blocks
    res: dict[str, float | int | str] = {
        "blocks": tree.stats()["host_kv_used"],
        "nodes": tree.stats()["nodes"],
        "conversations": len(convs),
        "match_p50_us": round(pct(mt, 0.5), 2),
        "match_p99_us": round(pct(mt, 0.99), 2),
        "insert_p50_us": round(pct(ins, 0.5), 2),
        "insert_p99_us": round(pct(ins, 0.99), 2),
        "avg_hit_blocks": round(hit_blocks / len(queries), 1),
        "build_s": round(build_s, 1),
        "rss_mb": round(rss1, 1),
        "tree_rss_mb": round(rss1 - rss0, 1),
        "tree_bytes_per_block": round((rss1 - rss0) * 2**20 / max(1, args.blocks)),
        "tree_key_bytes_per_block": round(key_bytes / max(1, args.blocks)),
    }
    ev, evm = [], []
    for _ in range(1000):
        t = clock()
        evict_host(tree, TURN_BLOCKS)
        ev.append(clock() - t)
        t = clock()
        evict_host_mamba(tree, 1)
        evm.append(clock() - t)
    res["evict_p50_us"] = round(pct(ev, 0.5), 2)
    res["evict_mamba_p50_us"] = round(pct(evm, 0.5), 2)
    if not args.no_vllm:
        del tree
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401  (import cost is not index cost)

        gc.collect()
        r0 = rss_mb()
        mgr, ReqContext, key = vllm_index(convs, capacity)
        gc.collect()
        res["vllm_index_rss_mb"] = round(rss_mb() - r0, 1)
        ctx = ReqContext(req_id="q")
        HIT = type(mgr.lookup(key(convs[0][0], 0), ctx)).HIT
        vt = []
        for q, start in queries:
            t = clock()
            n = start
            while n < len(q) and mgr.lookup(key(q[n], 0), ctx) is HIT:
                n += 1
            vt.append(clock() - t)
        res["vllm_lookup_p50_us"] = round(pct(vt, 0.5), 2)
        res["vllm_lookup_p99_us"] = round(pct(vt, 0.99), 2)
        res["match_vs_vllm_p50"] = round(pct(mt, 0.5) / max(pct(vt, 0.5), 1e-9), 2)
    print(json.dumps(res) if args.json else res)


if __name__ == "__main__":
    main()
