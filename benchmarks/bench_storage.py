"""Storage-tier throughput: `LMCacheStore` put/get vs raw Python I/O of the same bytes.

N objects of S bytes (default 256 x 1 MiB, random) go through our store (staging copy at
submit + header + checksum (`--checksum`, default the config's) + LMCache L2 adapter) on
`fs_native` and `fs` over a temp directory and on `resp` over a private redis-server (127.0.0.1, free port, no persistence). The references, same run,
same bytes: one file per object with open/write/close and open/readinto (page-cache warm, like
the adapter reads), and for Redis a redis-py pipeline of SET/GET. Ratio = ours / reference.
`*_in_place` read as the connector's fetches do: each object lent to the adapter as its host
slot (`ObjectView` over a `HostSlotPool` slot of 32 layer rows with header room), read there and
checked there, no copy of ours; `fs_native_staged_slot` as a fetch beyond the pool's spares
does (adapter -> staging buffer -> check -> copy into the slot).
Reps are interleaved across variants and each write phase starts after `os.sync()`, so dirty-page
writeback from one variant does not land on the next; best of `--reps`.

    python -m benchmarks.bench_storage                  # ~1 min on a 2-core VM
    python -m benchmarks.bench_storage --objects 64     # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.lmcache_store import LMCacheStore
from himamba.tiers.object_format import (
    HEADER_SIZE,
    LayoutFingerprint,
    Namespace,
    ObjectKind,
    StorageKey,
)
from himamba.tiers.staging import ObjectView
from himamba.tiers.storage_config import StorageConfig

SLOT_LAYERS = 32  # per-layer rows of a host slot (the "in_place" and "staged_slot" variants)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _timed(fn) -> float:
    os.sync()  # start every write phase with no dirty pages left by the previous one
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class StoreRun:
    """One `LMCacheStore` kept open across reps (as the connector keeps it). Its write buffer
    holds the whole working set: this measures throughput, not backpressure (a put refused
    for room would fail the run's assertion, never pass silently)."""

    def __init__(
        self, where: str | dict, working_set_bytes: int, checksum: str | None, dst: str = "buffer"
    ) -> None:
        # dst: "buffer" (a caller buffer per object, staged), "in_place" (the connector's fetch:
        # the host slot lent to the adapter), "staged_slot" (staged, then copied into the slot).
        self.dst = dst
        self.pool: HostSlotPool | None = None
        cfg = {"adapter": where} if isinstance(where, dict) else {"url": where}
        write_buffer_mb = 2 * (working_set_bytes >> 20) + 64
        self.store = LMCacheStore(
            StorageConfig.from_dict(
                {
                    **cfg,
                    "op_deadline_s": 120.0,
                    "probe_interval_s": 3600,
                    "write_buffer_mb": write_buffer_mb,
                    **({"checksum": checksum} if checksum else {}),
                }
            ),
            Namespace("bench/model", LayoutFingerprint(16, "bfloat16", (1,))),
        )

    def rep(self, rep: int, objs: list[torch.Tensor], batch: int) -> tuple[float, float]:
        s = self.store
        keys = [
            StorageKey(f"{rep}:{i}".encode().ljust(32, b"."), ObjectKind.KV)
            for i in range(len(objs))
        ]
        dsts: list = [torch.zeros_like(o) for o in objs]
        if self.pool is None:  # one pool for all reps, as the connector's (pages faulted once)
            rows = [objs[0].numel() // SLOT_LAYERS] * SLOT_LAYERS
            self.pool = HostSlotPool(rows, len(objs), head_bytes=HEADER_SIZE)
        pool = self.pool
        if self.dst == "in_place":
            dsts = [ObjectView(pool.slot_object(i)) for i in range(len(objs))]
        elif self.dst == "staged_slot":
            dsts = [pool.slot_payload(i) for i in range(len(objs))]

        def run(submit, bufs) -> None:
            tids = [
                submit(keys[i : i + batch], bufs[i : i + batch]) for i in range(0, len(objs), batch)
            ]
            assert all(s.wait(x, 300).num_ok == len(bufs[:batch]) for x in tids)

        tw = _timed(lambda: run(s.submit_put, objs))
        if self.dst != "buffer":
            for i in range(len(objs)):
                pool.slot_object(i)[:] = 0
        tr = _timed(lambda: run(s.submit_get, dsts))
        if self.dst == "buffer":
            assert all(torch.equal(a, b) for a, b in zip(dsts, objs, strict=True))
        else:
            got = [pool.slot_payload(i) for i in range(len(objs))]
            assert all(np.array_equal(g, o.numpy()) for g, o in zip(got, objs, strict=True))
        s.wait(s.submit_delete(keys), 60)  # keep disk / Redis usage flat across reps
        return tw, tr

    def close(self) -> None:
        self.store.close()


def raw_files_rep(d: Path, rep: int, objs: list[torch.Tensor]) -> tuple[float, float]:
    paths = [d / f"raw{rep}_{i}.bin" for i in range(len(objs))]
    dsts = [torch.zeros_like(o) for o in objs]

    def write() -> None:
        for p, o in zip(paths, objs, strict=True):
            with open(p, "wb") as f:
                f.write(o.numpy().data)

    def read() -> None:
        for p, o in zip(paths, dsts, strict=True):
            with open(p, "rb", buffering=0) as f:
                f.readinto(o.numpy().data)

    tw, tr = _timed(write), _timed(read)
    for p in paths:
        p.unlink()
    return tw, tr


def raw_redis_rep(srv, rep: int, objs: list[torch.Tensor]) -> tuple[float, float]:
    c = srv.client()

    def write() -> None:
        p = c.pipeline(transaction=False)
        for i, o in enumerate(objs):
            p.set(f"raw{rep}:{i}", o.numpy().tobytes())
        p.execute()

    def read() -> None:
        p = c.pipeline(transaction=False)
        for i in range(len(objs)):
            p.get(f"raw{rep}:{i}")
        for v, o in zip(p.execute(), dsts, strict=True):
            o.numpy()[:] = memoryview(v)

    dsts = [torch.zeros_like(o) for o in objs]
    tw, tr = _timed(write), _timed(read)
    c.flushall()
    return tw, tr


def throughput_args(ap: argparse.ArgumentParser, objects: int, batch: int) -> None:
    """The options every storage throughput benchmark takes (object count and size, batch)."""
    ap.add_argument("--objects", type=int, default=objects)
    ap.add_argument("--object-kib", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=batch, help="objects per submitted task")
    ap.add_argument("--reps", type=int, default=3, help="best of (interleaved reps)")


def random_objects(args: argparse.Namespace) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = args.object_kib << 10
    return [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for _ in range(args.objects)
    ]


def best_of_interleaved(
    runs: dict, reps: int, objs: list[torch.Tensor], batch: int
) -> dict[str, dict[str, float]]:
    """Each run's best write and read GB/s over ``reps`` rounds; the runs alternate within a
    round, so the machine's drift hits every one alike. A run is a ``StoreRun`` or a callable
    ``rep -> (write s, read s)``."""
    best: dict = {k: [float("inf"), float("inf")] for k in runs}
    for rep in range(reps):
        for name, r in runs.items():
            tw, tr = r.rep(rep, objs, batch) if isinstance(r, StoreRun) else r(rep)
            best[name] = [min(best[name][0], tw), min(best[name][1], tr)]
    total = sum(o.nbytes for o in objs)
    return {
        name: {"write_GBps": _gbps(total, tw), "read_GBps": _gbps(total, tr)}
        for name, (tw, tr) in best.items()
    }


def _ratio(ours: dict, ref: dict) -> dict:
    keys = ("write_GBps", "read_GBps")
    return {k.replace("GBps", "ratio"): round(ours[k] / ref[k], 3) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    throughput_args(ap, objects=256, batch=32)
    ap.add_argument("--dir", default=None, help="directory for files (default: a temp dir)")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument(
        "--checksum", default=None, help="storage.checksum (default: the config's default)"
    )
    args = ap.parse_args()
    objs = random_objects(args)
    n = args.object_kib << 10
    root = Path(tempfile.mkdtemp(prefix="bench_storage_", dir=args.dir))
    out: dict = {"objects": args.objects, "object_bytes": n, "batch": args.batch, "reps": args.reps}
    out["checksum"] = args.checksum or StorageConfig.checksum
    total = sum(o.nbytes for o in objs)
    srv = None
    try:
        (root / "raw").mkdir()
        runs: dict = {
            "raw_file": lambda r: raw_files_rep(root / "raw", r, objs),
            "fs_native": StoreRun(f"file://{root / 'fsn'}", total, args.checksum),
            "fs_native_in_place": StoreRun(
                f"file://{root / 'fsn2'}", total, args.checksum, "in_place"
            ),
            "fs_native_staged_slot": StoreRun(
                f"file://{root / 'fsn3'}", total, args.checksum, "staged_slot"
            ),
            "fs": StoreRun(
                {"type": "fs", "base_path": str(root / "fs"), "relative_tmp_dir": "tmp"},
                total,
                args.checksum,
            ),
        }
        if not args.no_redis and shutil.which("redis-server"):
            from tests.harness.redis_server import RedisServer

            srv = RedisServer(root)
            srv.start()
            runs["raw_redis_py"] = lambda r: raw_redis_rep(srv, r, objs)
            runs["resp"] = StoreRun(srv.url, total, args.checksum)
            runs["resp_in_place"] = StoreRun(srv.url, total, args.checksum, "in_place")
        out.update(best_of_interleaved(runs, args.reps, objs, args.batch))
        variants = ("fs_native", "fs_native_in_place", "fs_native_staged_slot", "fs")
        for name in (*variants, "resp", "resp_in_place"):
            if name in out:
                out[name].update(_ratio(out[name], out["raw_file"]))
        for name in ("resp", "resp_in_place"):
            if name in out:
                vs = _ratio(out[name], out["raw_redis_py"])
                out[name].update({f"vs_redis_py_{k}": v for k, v in vs.items()})
        for r in runs.values():
            if isinstance(r, StoreRun):
                r.close()
    finally:
        if srv is not None:
            srv.kill()
        shutil.rmtree(root, ignore_errors=True)
    out["cpus"] = os.cpu_count()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
