"""Storage probe latency: how long the scheduler's ``exists`` of one request's keys takes.

A probe asks for every block's KV object and Mamba state of a prompt (2 x blocks keys) and
sits on the request's path to its first token. Measured through our whole store
(``LMCacheStore.submit_exists`` then ``wait``: task book, driver thread, adapter, eventfd), on
a 3-node Redis Cluster on loopback (tests/harness/redis_cluster.py) and a standalone
redis-server, half of the keys present:

- ``cluster_batched``: the cluster adapter as the connector builds it, with the pipelined
  lookup of ``tiers/valkey_lookup.py`` (one GLIDE batch per probe);
- ``cluster_per_key``: the same adapter as LMCache ships it (one ``EXISTS`` future per key);
- ``resp``: LMCache's RESP adapter on the standalone server (what ``redis://`` uses).

Reps interleaved (A B C A B C ...); median and p90 in ms, ratios against ``cluster_per_key``.

``--file`` instead measures the local file store (``file://``, LMCache's ``fs_native``), where
a probe's cost is CPU, not network: the process CPU time (every thread) per probe of
``--keys`` keys, probed one at a time and as a burst of ``--burst`` probes submitted together
(an engine receiving that many prompts at once; vLLM's scheduler waits for the first ones'
answers while the store's threads work through the rest, competing with it for the GIL), and
when the burst's first and last answers came back.
Half of the keys present, as above.

    python -m benchmarks.bench_probe                 # ~20 s on a 2-core VM
    python -m benchmarks.bench_probe --keys 112,512
    python -m benchmarks.bench_probe --file --keys 64 --burst 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks.bench_cluster_storage import redis_servers
from himamba.tiers.cluster_url import cluster_adapter_spec
from himamba.tiers.lmcache_store import LMCacheStore
from himamba.tiers.object_format import LayoutFingerprint, Namespace, ObjectKind, StorageKey
from himamba.tiers.storage_config import StorageConfig


def per_key_adapter(spec: dict[str, Any]) -> Any:
    """LMCache's adapter exactly as its factory builds it (no batched lookup)."""
    import lmcache.v1.distributed.l2_adapters.valkey_l2_adapter  # noqa: F401  (registers it)
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

    return create_l2_adapter_from_registry(
        get_l2_adapter_config_class(spec["type"]).from_dict(spec)
    )


def open_store(where: str | dict, factory: Any = None) -> LMCacheStore:
    cfg = {"adapter": where} if isinstance(where, dict) else {"url": where}
    return LMCacheStore(
        StorageConfig.from_dict({**cfg, "probe_interval_s": 3600, "op_deadline_s": 60.0}),
        Namespace("bench/model", LayoutFingerprint(16, "float32", (1,))),
        adapter_factory=factory,
    )


def seed(store: LMCacheStore, keys: list[StorageKey]) -> None:
    """Write every other key (small objects: a probe's cost does not depend on their size)."""
    present = keys[::2]
    bufs = [np.full(64, i % 251, dtype=np.uint8) for i in range(len(present))]
    res = store.wait(store.submit_put(present, bufs), 60)
    assert res is not None and res.num_ok == len(present), res


def probe_ms(store: LMCacheStore, keys: list[StorageKey]) -> float:
    t = time.perf_counter()
    res = store.wait(store.submit_exists(keys), 30)
    dt = time.perf_counter() - t
    assert res is not None and res.error is None, res
    assert list(res.ok) == [i % 2 == 0 for i in range(len(keys))], "wrong probe answer"
    return 1e3 * dt


def probe_row(stores: dict[str, LMCacheStore], n: int, reps: int) -> dict[str, Any]:
    """Median and p90 of ``reps`` interleaved probes of ``n`` keys on each store."""
    keys = [StorageKey(os.urandom(32), ObjectKind.KV) for _ in range(n)]
    for s in stores.values():
        seed(s, keys)
    times: dict[str, list[float]] = {name: [] for name in stores}
    for _ in range(reps):
        for name, s in stores.items():
            times[name].append(probe_ms(s, keys))
    row: dict[str, Any] = {}
    for name, xs in times.items():
        xs.sort()
        row[name] = {
            "median_ms": round(statistics.median(xs), 3),
            "p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 3),
        }
    base = row["cluster_per_key"]["median_ms"]
    for r in row.values():
        r["x_cluster_per_key"] = round(r["median_ms"] / base, 3)
    return row


def file_row(store: LMCacheStore, n: int, reps: int, burst: int) -> dict[str, Any]:
    """Latency and process CPU per probe of ``n`` keys: ``reps`` one at a time, then
    ``reps // 10 + 1`` bursts of ``burst`` probes submitted together."""
    keys = [StorageKey(os.urandom(32), ObjectKind.KV, "epoch") for _ in range(n)]
    seed(store, keys)
    lat, cpu = [], []
    for _ in range(reps):
        c = time.process_time()
        lat.append(probe_ms(store, keys))
        cpu.append(1e6 * (time.process_time() - c))
    burst_ms, burst_first_ms, burst_cpu = [], [], []
    for _ in range(reps // 10 + 1):
        t, c = time.perf_counter(), time.process_time()
        left = {store.submit_exists(keys) for _ in range(burst)}
        first, until = None, t + 60
        while left and time.perf_counter() < until:
            for res in store.poll():
                if res.task_id in left:
                    assert res.error is None, res
                    left.discard(res.task_id)
                    first = first or 1e3 * (time.perf_counter() - t)
            time.sleep(0.0002)
        assert not left, f"{len(left)} probes unanswered"
        burst_ms.append(1e3 * (time.perf_counter() - t))
        burst_first_ms.append(first)
        burst_cpu.append(1e6 * (time.process_time() - c) / burst)
    return {
        "serial_median_ms": round(statistics.median(lat), 3),
        "serial_cpu_us_per_probe": round(statistics.median(cpu), 1),
        "burst": burst,
        # When the first of the burst's answers came back, and the last.
        "burst_first_answer_ms": round(statistics.median(burst_first_ms), 1),
        "burst_median_ms": round(statistics.median(burst_ms), 1),
        "burst_cpu_us_per_probe": round(statistics.median(burst_cpu), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="112,512", help="keys per probe (2 x prompt blocks)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--file", action="store_true", help="the local file store (fs_native)")
    ap.add_argument("--burst", type=int, default=256, help="--file: probes per burst")
    args = ap.parse_args()
    out: dict[str, Any] = {"reps": args.reps, "cpus": os.cpu_count()}
    if args.file:
        with tempfile.TemporaryDirectory(prefix="bench_probe_") as d:
            store = open_store(f"file://{d}")
            try:
                for n in (int(x) for x in args.keys.split(",")):
                    out[f"file_{n}"] = file_row(store, n, args.reps, args.burst)
            finally:
                store.close()
        print(json.dumps(out, indent=1))
        return
    stores: dict[str, LMCacheStore] = {}
    with redis_servers("bench_probe_") as (srv, cluster):
        try:
            stores = {
                "cluster_batched": open_store(cluster.url),
                "cluster_per_key": open_store(
                    cluster_adapter_spec(cluster.url), factory=per_key_adapter
                ),
                "resp": open_store(srv.url),
            }
            for n in (int(x) for x in args.keys.split(",")):
                out[str(n)] = probe_row(stores, n, args.reps)
        finally:
            for s in stores.values():
                s.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
