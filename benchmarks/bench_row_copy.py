"""Random-id row copies on CPU: the native streaming-store helper vs the numpy path vs one
plain memcpy of the same bytes, interleaved in one process.

This box's memory bandwidth moves by +-30% between runs (other tenants), so the three are
timed round-robin, iteration by iteration, on the same random plans (``bench_transfer``'s
layers: 32 layers of 64 KiB pages, 4 attention + 28 Mamba views). Each copy runs on the
calling thread only, as on the connector's copy thread. Reports medians and the ratios to the
plain memcpy (warm: one contiguous copy between two buffers of the batch's size) and to a cold
memcpy (the same bytes between regions that move through 1 GiB, out of cache like ours).

The connector streams only batches of at least ``stream_min_bytes()`` (3/4 of the L3); the
benchmark times the helper at every size and says which side of that line each size is on.

    python -m benchmarks.bench_row_copy                 # ~1 min
    python -m benchmarks.bench_row_copy --blocks 8,64 --iters 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from benchmarks.bench_transfer import build_layers
from himamba.tiers import transfer
from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.native_copy import native_row_copy, stream_min_bytes
from himamba.tiers.object_format import HEADER_SIZE
from himamba.tiers.transfer import plan_copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="8,32,64", help="comma list of blocks per batch")
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=256)
    a = ap.parse_args()
    helper = native_row_copy()
    if helper is None:
        raise SystemExit("the native helper is not available here (see the log)")
    threshold = stream_min_bytes()
    transfer.stream_min_bytes = lambda: 0  # time the helper at every size
    layers = build_layers(a.num_blocks, 4, 28, "cpu")
    pool = HostSlotPool([lb.block_bytes for lb in layers], a.slots, head_bytes=HEADER_SIZE)
    pool._buffer.fill_(1)
    gen = torch.Generator().manual_seed(1)
    cold = np.ones(2 << 30, dtype=np.uint8)
    cursor = 0
    for n in (int(x) for x in a.blocks.split(",")):
        nbytes = n * pool.slot_bytes
        src, dst = np.full(nbytes, 3, np.uint8), np.zeros(nbytes, np.uint8)
        times: dict[str, list[float]] = {
            k: [] for k in ("native_d2h", "numpy_d2h", "native_h2d", "numpy_h2d", "memcpy", "cold")
        }
        for it in range(a.iters + 1):
            ids = (torch.randperm(a.num_blocks - 1, generator=gen)[:n] + 1).tolist()
            slots = torch.randperm(a.slots, generator=gen)[:n].tolist()
            for name in ("native", "numpy"):
                for d, to_host in (("d2h", True), ("h2d", False)):
                    transfer.native_row_copy = (
                        (lambda: helper) if name == "native" else (lambda: None)
                    )
                    t = time.perf_counter()
                    plan_copies(layers, [ids] * len(layers), pool, slots, to_host).run_host()
                    times[f"{name}_{d}"].append(time.perf_counter() - t)
            t = time.perf_counter()
            np.copyto(dst, src)
            times["memcpy"].append(time.perf_counter() - t)
            half = cold.size // 2
            cursor = (cursor + nbytes + 4096) % (half - nbytes)
            t = time.perf_counter()
            np.copyto(cold[half + cursor : half + cursor + nbytes], cold[cursor : cursor + nbytes])
            times["cold"].append(time.perf_counter() - t)
            if it == 0:  # warm-up round
                for v in times.values():
                    v.clear()
        med = {k: statistics.median(v) for k, v in times.items()}
        line = {"blocks": n, "bytes": nbytes, "connector_streams": nbytes >= threshold}
        line.update({f"{k}_gb_per_s": round(nbytes / v / 1e9, 2) for k, v in med.items()})
        for k in ("native_d2h", "numpy_d2h", "native_h2d", "numpy_h2d"):
            line[f"{k}_vs_memcpy"] = round(med["memcpy"] / med[k], 3)
            line[f"{k}_vs_cold"] = round(med["cold"] / med[k], 3)
        line["load_avg_1min"] = os.getloadavg()[0]
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
