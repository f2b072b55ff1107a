"""CPU-tier copy throughput through the copy engine vs a plain memcpy of the same bytes.

Caches are laid out as vLLM lays out a hybrid model's: one raw int8 buffer per layer of
``num_blocks * page`` bytes (page = 64 KiB), viewed either as an attention cache
``[num_blocks, 2, 8, 2048]`` bf16 (the whole page, K and V halves) or as a Mamba state view
``[num_blocks, 1, 1, 36032]`` int8 with block stride 65536 (the state uses only the first
36032 bytes of each padded page). Each batch copies ``n`` random distinct blocks of every
layer to / from ``n`` random host slots (``HostSlotPool``), as the connector's stores and
loads do; ``--ids consecutive`` uses consecutive blocks and slots (a fresh request's blocks from
vLLM's free queue into slots handed out in order: one copy per layer). Each batch is one job on
the copy engine the connector uses (``HostCopyEngine`` thread on CPU, ``CudaCopyEngine`` batched
DMA on a GPU), timed from planning to completion. The reference is ``dst.copy_(src)`` of one contiguous tensor of the same number
of bytes, in the same run. Output: one JSON line per (direction, batch size), then a summary.

    python -m benchmarks.bench_transfer           # ~1-2 min
    python -m benchmarks.bench_transfer --quick   # ~15 s
    python -m benchmarks.bench_transfer --quick --ids consecutive
    python -m benchmarks.bench_transfer --device cuda --quick   # on a GPU (benchmarks/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.object_format import HEADER_SIZE
from himamba.tiers.transfer import LayerBlocks, plan_copies
from himamba.tiers.transfer_engine import make_copy_engine
from tests.harness.cuda_batch_op import batched_copy_op

PAGE = 65536
MAMBA_STATE_BYTES = 36032


def build_layers(
    num_blocks: int,
    n_attn: int,
    n_mamba: int,
    device: str,
    page: int = PAGE,
    state_bytes: int = MAMBA_STATE_BYTES,
) -> list[LayerBlocks]:
    """Per layer one raw buffer of ``num_blocks`` pages: an attention cache (K and V halves of
    the page) or a Mamba state using the first ``state_bytes`` of each page."""
    layers = []
    for i in range(n_attn + n_mamba):
        raw = torch.zeros(num_blocks * page, dtype=torch.int8, device=device)
        raw.fill_(i % 100 + 1)
        # Block-distinct bytes at the start of each page, for the round-trip check.
        raw.view(num_blocks, page)[:, :64].copy_(
            (torch.arange(num_blocks * 64, device=device) * 7 + i)
            .view(num_blocks, 64)
            .to(torch.int8)
        )
        if i < n_attn:
            t = raw.view(torch.bfloat16).view(num_blocks, 2, 8, page // 32)
            name = f"attn.{i}"
        else:
            t = raw.as_strided(
                (num_blocks, 1, 1, state_bytes),
                (page, state_bytes, state_bytes, 1),
            )
            name = f"mamba.{i}"
        layers.append(LayerBlocks.wrap(name, t, num_blocks))
    return layers


def timed(fn: Callable[[], object], iters: int) -> list[float]:
    fn()  # warm-up: first-touch of destination pages, allocator
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations and batch sizes")
    ap.add_argument("--num-blocks", type=int, default=1024, help="blocks per layer cache")
    ap.add_argument("--attn-layers", type=int, default=4)
    ap.add_argument("--mamba-layers", type=int, default=28)
    ap.add_argument("--slots", type=int, default=256, help="host pool slots")
    ap.add_argument("--batches", default=None, help="comma list of blocks per batch")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ids", default="random", choices=["random", "consecutive"])
    ap.add_argument(
        "--op",
        default="auto",
        choices=["auto", "direct", "torch"],
        help="GPU: batched DMA, scattered rows staged into whole slots (auto) or the plan's "
        "own pointer lists (direct); or torch slice copies (the fallback)",
    )
    a = ap.parse_args()
    batches = [int(x) for x in (a.batches or ("8,64" if a.quick else "8,16,32,64")).split(",")]
    iters = a.iters or (5 if a.quick else 15)
    if max(batches) > min(a.slots, a.num_blocks - 1):
        raise SystemExit("batch larger than the pool or the cache")

    torch.manual_seed(0)
    t0 = time.perf_counter()
    layers = build_layers(a.num_blocks, a.attn_layers, a.mamba_layers, a.device)
    # As the connector's pools: slot-major, header room for in-place storage reads.
    rows = [lb.block_bytes for lb in layers]
    pool = HostSlotPool(rows, a.slots, pin=a.device == "cuda", head_bytes=HEADER_SIZE)
    pool._buffer.fill_(1)  # fault the pool in before timing
    setup_s = time.perf_counter() - t0
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    engine = make_copy_engine(a.device == "cuda")
    op_name = "host copy engine"
    if a.device == "cuda":  # the pointer-list path even on a GPU machine without vLLM
        op, op_name = batched_copy_op() if a.op != "torch" else (None, "torch")
        engine._op = op
        if a.op != "auto":
            engine.staging = None
        if op is None:
            op_name = "torch"  # the engine's slice-copy fallback
        elif engine.staging is not None:
            op_name += ", staged"
    gen = torch.Generator().manual_seed(1)

    # 2 GiB, faulted in: the cold memcpy reference copies within it (see cold_memcpy).
    cold_np = np.ones(2 << 30, dtype=np.uint8) if a.device == "cpu" else np.ones(1, np.uint8)
    cursor = [0]
    results = []
    # Where a job's time goes: planning and queueing it on this thread (the fixed CPU cost per
    # job), and the job itself as the engine times it (events on a GPU stream).
    issue_s: list[float] = []
    job_s: list[float] = []
    for n in batches:
        # Fresh random block ids (never block 0, vLLM's null block) and slots per call.
        def pick(n: int = n) -> tuple[list[list[int]], list[int]]:
            if a.ids == "consecutive":
                b0 = int(torch.randint(1, a.num_blocks - n, (1,), generator=gen))
                s0 = int(torch.randint(0, a.slots - n + 1, (1,), generator=gen))
                return [list(range(b0, b0 + n))] * len(layers), list(range(s0, s0 + n))
            ids = (torch.randperm(a.num_blocks - 1, generator=gen)[:n] + 1).tolist()
            slots = torch.randperm(a.slots, generator=gen)[:n].tolist()
            return [ids] * len(layers), slots

        nbytes = n * pool.slot_bytes
        src = torch.empty(nbytes, dtype=torch.uint8, device=a.device).fill_(3)
        # Pinned on a GPU, as our pool is: the reference is the fastest plain DMA.
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=a.device == "cuda").fill_(0)

        def plain(dst: torch.Tensor = dst, src: torch.Tensor = src) -> None:
            dst.copy_(src)
            sync()

        # On CPU the fair reference is a raw memcpy of the same bytes (numpy copyto);
        # torch's own CPU copy_ of uint8 is far slower on this build, see docs.
        def memcpy(dst: torch.Tensor = dst, src: torch.Tensor = src) -> None:
            if src.device.type == "cpu":
                np.copyto(dst.numpy(), src.numpy())
            else:
                dst.copy_(src)
            sync()

        def run(to_host: bool, nbytes: int = nbytes, pick: Callable = pick) -> Callable[[], None]:
            def call() -> None:
                ids, slots = pick()
                t0 = time.perf_counter()
                plan = plan_copies(layers, ids, pool, slots, to_host)
                job = engine.submit([plan])
                issue_s.append(time.perf_counter() - t0)
                engine.wait([job])
                (done,) = engine.collect([job])
                assert done.ok and plan.nbytes == nbytes
                job_s.append(done.seconds)

            return call

        # A store reads blocks that are not in the CPU's caches and writes slots that are not
        # either; a memcpy that re-reads one 10 MB buffer into another is all cache hits. So the
        # fair reference: one memcpy of the same number of bytes between two regions that move
        # through 1 GiB each call (out of cache on both sides, like ours).
        def cold_memcpy(nbytes: int = nbytes) -> None:
            if a.device != "cpu":
                return
            half = cold_np.size // 2
            o = cursor[0] = (cursor[0] + nbytes + 4096) % (half - nbytes)
            np.copyto(cold_np[half + o : half + o + nbytes], cold_np[o : o + nbytes])

        base_torch = statistics.median(timed(plain, iters))
        base_cold = statistics.median(timed(cold_memcpy, iters))
        base = statistics.median(timed(memcpy, iters))
        for direction, to_host in (("device_to_host", True), ("host_to_device", False)):
            issue_s.clear()
            job_s.clear()
            t = statistics.median(timed(run(to_host), iters))
            line = {
                "direction": direction,
                "ids": a.ids,
                "blocks_per_batch": n,
                "layers": len(layers),
                "bytes_per_batch": nbytes,
                "median_s": round(t, 6),
                "gb_per_s": round(nbytes / t / 1e9, 3),
                "plain_copy_gb_per_s": round(nbytes / base / 1e9, 3),
                "torch_copy_gb_per_s": round(nbytes / base_torch / 1e9, 3),
                "ratio_vs_plain_copy": round(base / t, 3),
                "issue_ms": round(1e3 * statistics.median(issue_s), 3),
                "job_ms": round(1e3 * statistics.median(job_s), 3),
                "cold_copy_gb_per_s": round(nbytes / base_cold / 1e9, 3),
                "ratio_vs_cold_copy": round(base_cold / t, 3),
            }
            print(json.dumps(line), flush=True)
            results.append(line)

    # Correctness spot check: a round trip through the pool restores the same bytes.
    ids, slots = [list(range(1, 9))] * len(layers), list(range(8))
    before = [lb.read_blocks(ids[0]).clone() for lb in layers]
    engine.wait([engine.submit([plan_copies(layers, ids, pool, slots, True)])])
    for lb in layers:
        lb.tensor.index_fill_(0, torch.tensor(ids[0], device=a.device), 0)
    engine.wait([engine.submit([plan_copies(layers, ids, pool, slots, False)])])
    sync()
    engine.close()
    exact = all(
        torch.equal(b, lb.read_blocks(ids[0])) for b, lb in zip(before, layers, strict=True)
    )

    print(
        json.dumps(
            {
                "summary": True,
                "device": a.device,
                "ids": a.ids,
                "engine": type(engine).__name__,
                "copy_op": op_name,
                "threads": torch.get_num_threads(),
                "nproc": os.cpu_count(),
                "num_blocks": a.num_blocks,
                "attn_layers": a.attn_layers,
                "mamba_layers": a.mamba_layers,
                "slot_bytes": pool.slot_bytes,
                "iters": iters,
                "setup_s": round(setup_s, 2),
                "round_trip_exact": exact,
                "median_ratio_vs_cold": round(
                    statistics.median(r["ratio_vs_cold_copy"] for r in results), 3
                ),
                "median_ratio_vs_plain": round(
                    statistics.median(r["ratio_vs_plain_copy"] for r in results), 3
                ),
                "load_avg_1min": os.getloadavg()[0],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
