"""CPU time to plan and queue one staged GPU copy job (``tiers.cuda_staging``), on any box.

On a GPU a staged job's fixed cost is CPU work: building the plan, working out the layout,
uploading the ids and launching one gather (store) or scatter (load) per segment, while the
copy stream waits for it; an H200 run measured ~1 ms per job, which is why 8-block batches
(10 MB) gained nothing from staging (docs/BENCHMARKS.md, "Random-id copies on a GPU"). Here
the same plans run through the same code with host memory standing in for the device and the
DMA left out, on rows a few hundred bytes wide, so what is timed is the per-job Python and
per-op dispatch, not the bytes. The layer shapes are ``bench_transfer``'s (4 attention + 28
Mamba layers, the Mamba state a padded part of its page), scaled down.

    python -m benchmarks.bench_staging_issue              # ~10 s
    python -m benchmarks.bench_staging_issue --batches 8,64 --iters 400
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.bench_transfer import build_layers
from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.cuda_staging import DeviceStaging, worth_staging
from himamba.tiers.object_format import HEADER_SIZE
from himamba.tiers.transfer import plan_copies

PAGE = 256  # bytes per block and layer (bench_transfer: 64 KiB)
MAMBA_STATE_BYTES = 144  # of which a Mamba state uses (bench_transfer: 36032)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--attn-layers", type=int, default=4)
    ap.add_argument("--mamba-layers", type=int, default=28)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--batches", default="8,64", help="comma list of blocks per job")
    ap.add_argument("--iters", type=int, default=300)
    a = ap.parse_args()
    torch.set_num_threads(1)  # a GPU job's launches come from one thread
    layers = build_layers(
        a.num_blocks, a.attn_layers, a.mamba_layers, "cpu", PAGE, MAMBA_STATE_BYTES
    )
    pool = HostSlotPool([lb.block_bytes for lb in layers], a.slots, head_bytes=HEADER_SIZE)
    staging = DeviceStaging(torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)

    def no_dma(src: list[int], dst: list[int], sizes: list[int]) -> None:
        pass

    for n in [int(x) for x in a.batches.split(",")]:
        for to_host in (True, False):
            plan_s, issue_s = [], []
            for _ in range(a.iters):
                ids = (torch.randperm(a.num_blocks - 1, generator=gen)[:n] + 1).tolist()
                slots = torch.randperm(a.slots, generator=gen)[:n].tolist()
                t0 = time.perf_counter()
                plan = plan_copies(layers, [ids] * len(layers), pool, slots, to_host)
                t1 = time.perf_counter()
                # As the copy engine issues it: is it worth staging, then the staged issue.
                assert worth_staging(plan) and staging.issue(plan, no_dma)
                t2 = time.perf_counter()
                plan_s.append(t1 - t0)
                issue_s.append(t2 - t1)
            plan_us = 1e6 * statistics.median(plan_s)
            issue_us = 1e6 * statistics.median(issue_s)
            line = {
                "direction": "device_to_host" if to_host else "host_to_device",
                "blocks_per_job": n,
                "segments": len(plan.segments),
                "plan_us": round(plan_us, 1),
                "issue_us": round(issue_us, 1),
                "total_us": round(plan_us + issue_us, 1),
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
