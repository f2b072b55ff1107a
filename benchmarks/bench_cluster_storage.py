"""Storage throughput through a Redis Cluster (LMCache `valkey` adapter, cluster mode) vs a
standalone Redis (LMCache `resp` adapter) vs raw redis-py GET/SET of the same bytes.

N objects of S bytes (default 256 x 1 MiB, random) go through our `LMCacheStore` (staging copy,
header, checksum, adapter) exactly as `bench_storage.py` measures it, on:

- `cluster`: a 3-node Redis Cluster on loopback (tests/harness/redis_cluster.py), through
  `redis+cluster://` -> the `valkey` adapter (Valkey GLIDE's cluster client);
- `valkey_standalone`: the same `valkey` adapter on one standalone redis-server (isolates
  GLIDE's cost from the cluster's);
- `resp`: LMCache's native RESP adapter on that standalone server (what `redis://` uses);
- `raw_redis_py` / `raw_redis_py_cluster`: a redis-py pipeline of SET/GET of the same bytes on
  the standalone server / redis-py's cluster pipeline on the cluster (the references).

All servers run in this process's run, no persistence; reps interleaved, best of `--reps`.
Ratios: ours / reference. On a small VM the redis-servers, the client threads and the
checksum share the same cores, so absolute GB/s say more about the box than the store.

    python -m benchmarks.bench_cluster_storage               # ~1 min on a 2-core VM
    python -m benchmarks.bench_cluster_storage --objects 64  # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent

from benchmarks.bench_storage import (  # noqa: E402
    StoreRun,
    _ratio,
    _timed,
    best_of_interleaved,
    random_objects,
    raw_redis_rep,
    throughput_args,
)
from himamba.tiers.cluster_url import cluster_adapter_spec  # noqa: E402


@contextmanager
def redis_servers(prefix: str) -> Iterator[tuple[Any, Any]]:
    """A standalone redis-server and a 3-node cluster on loopback, both gone on exit."""
    from tests.harness.redis_cluster import RedisCluster
    from tests.harness.redis_server import RedisServer

    if shutil.which("redis-server") is None:
        sys.exit("redis-server not installed (apt-get install -y redis-server)")
    root = Path(tempfile.mkdtemp(prefix=prefix))
    srv = cluster = None
    try:
        (root / "standalone").mkdir()
        srv = RedisServer(root / "standalone")
        srv.start()
        cluster = RedisCluster(root / "cluster")
        cluster.start()
        yield srv, cluster
    finally:
        if cluster is not None:
            cluster.stop()
        if srv is not None:
            srv.kill()
        shutil.rmtree(root, ignore_errors=True)


def raw_cluster_rep(cluster, rep: int, objs: list[torch.Tensor]) -> tuple[float, float]:
    c = cluster.client()
    dsts = [torch.zeros_like(o) for o in objs]
    keys = [f"raw{rep}:{i}" for i in range(len(objs))]

    def write() -> None:
        p = c.pipeline(transaction=False)
        for k, o in zip(keys, objs, strict=True):
            p.set(k, o.numpy().tobytes())
        p.execute()

    def read() -> None:
        p = c.pipeline(transaction=False)
        for k in keys:
            p.get(k)
        for v, o in zip(p.execute(), dsts, strict=True):
            o.numpy()[:] = memoryview(v)

    tw, tr = _timed(write), _timed(read)
    assert all(torch.equal(a, b) for a, b in zip(dsts, objs, strict=True))
    for k in keys:
        c.delete(k)
    c.close()
    return tw, tr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    throughput_args(ap, objects=256, batch=32)
    ap.add_argument("--checksum", default=None, help="storage.checksum (default: the config's)")
    args = ap.parse_args()
    objs = random_objects(args)
    n = args.object_kib << 10
    total = sum(o.nbytes for o in objs)
    out: dict = {"objects": args.objects, "object_bytes": n, "batch": args.batch, "reps": args.reps}
    runs: dict = {}
    with redis_servers("bench_cluster_") as (srv, cluster):
        try:
            standalone_valkey = {
                "type": "valkey",
                "startup_nodes": f"{srv.host}:{srv.port}",
                "num_workers": 4,
            }
            runs = {
                "raw_redis_py": lambda r: raw_redis_rep(srv, r, objs),
                "raw_redis_py_cluster": lambda r: raw_cluster_rep(cluster, r, objs),
                "resp": StoreRun(srv.url, total, args.checksum),
                "valkey_standalone": StoreRun(standalone_valkey, total, args.checksum),
                "cluster": StoreRun(cluster_adapter_spec(cluster.url), total, args.checksum),
            }
            out.update(best_of_interleaved(runs, args.reps, objs, args.batch))
            out["cluster"]["vs_resp"] = _ratio(out["cluster"], out["resp"])
            out["cluster"]["vs_raw_redis_py_cluster"] = _ratio(
                out["cluster"], out["raw_redis_py_cluster"]
            )
            out["cluster"]["vs_raw_redis_py"] = _ratio(out["cluster"], out["raw_redis_py"])
            out["valkey_standalone"]["vs_resp"] = _ratio(out["valkey_standalone"], out["resp"])
            out["resp"]["vs_raw_redis_py"] = _ratio(out["resp"], out["raw_redis_py"])
            out["keys_per_node_after"] = cluster.keys_per_node()
        finally:
            for r in runs.values():
                if isinstance(r, StoreRun):
                    r.close()
    out["cpus"] = os.cpu_count()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
