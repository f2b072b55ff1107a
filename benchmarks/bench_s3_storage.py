"""Storage throughput through an S3 API: our store on LMCache's `s3` adapter with the bounded
GET (`tiers/s3_bounds.py`) vs the adapter's own unbounded GET vs raw boto3 PUT/GET of the same
bytes.

N objects of S bytes (default 64 x 1 MiB, random) go through our `LMCacheStore` (staging copy,
header, checksum, adapter) as `bench_storage.py` measures it, on a local moto server (the tests'
S3 API, `tests/harness/s3_server.py`):

- `bounded`: `s3://` URL as a user configures it (every GET size-checked);
- `adapter_get`: the same with LMCache's own `_get_request` (what the bound replaces; never
  used in serving: an object longer than its buffer crashes the process);
- `raw_boto3`: boto3 `put_object` / `get_object` of the same bytes, one object at a time.

moto is a Python server on the same cores, so absolute GB/s say more about moto than about S3;
the first two rows differ only in the GET path, which is the point. Reps interleaved, best of
`--reps`.

    python -m benchmarks.bench_s3_storage            # ~1 min on a 2-core VM
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from unittest import mock

import torch

from benchmarks.bench_storage import (
    StoreRun,
    _ratio,
    _timed,
    best_of_interleaved,
    random_objects,
    throughput_args,
)
from tests.harness.s3_server import BUCKET, S3Server, ensure_bucket_host


def raw_boto3_rep(srv: S3Server, rep: int, objs: list[torch.Tensor]) -> tuple[float, float]:
    c = srv.client()
    keys = [f"raw{rep}:{i}" for i in range(len(objs))]
    dsts = [torch.zeros_like(o) for o in objs]

    def write() -> None:
        for k, o in zip(keys, objs, strict=True):
            c.put_object(Bucket=BUCKET, Key=k, Body=o.numpy().tobytes())

    def read() -> None:
        for k, o in zip(keys, dsts, strict=True):
            o.numpy()[:] = memoryview(c.get_object(Bucket=BUCKET, Key=k)["Body"].read())

    tw, tr = _timed(write), _timed(read)
    assert all(torch.equal(a, b) for a, b in zip(dsts, objs, strict=True))
    c.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys]})
    return tw, tr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    throughput_args(ap, objects=64, batch=16)
    args = ap.parse_args()
    ensure_bucket_host()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    objs = random_objects(args)
    n = args.object_kib << 10
    total = sum(o.nbytes for o in objs)
    out: dict = {"objects": args.objects, "object_bytes": n, "batch": args.batch, "reps": args.reps}
    srv = S3Server(Path(tempfile.mkdtemp(prefix="bench_s3_")))
    srv.start()
    runs: dict = {}
    try:
        runs["bounded"] = StoreRun(srv.url, total, None)
        with mock.patch("himamba.tiers.adapter_health.bound_gets", lambda adapter: False):
            runs["adapter_get"] = StoreRun(srv.url, total, None)
        runs["raw_boto3"] = lambda r: raw_boto3_rep(srv, r, objs)
        out.update(best_of_interleaved(runs, args.reps, objs, args.batch))
        out["bounded"]["vs_adapter_get"] = _ratio(out["bounded"], out["adapter_get"])
        out["bounded"]["vs_raw_boto3"] = _ratio(out["bounded"], out["raw_boto3"])
    finally:
        for r in runs.values():
            if isinstance(r, StoreRun):
                r.close()
        srv.stop()
    out["cpus"] = os.cpu_count()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
