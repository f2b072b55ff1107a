"""Storage-store helpers shared by the tiers and connector unit tests: a real `LMCacheStore` over a
real adapter, deterministic keys and payloads, a way to damage an object behind the store's back,
and an adapter that starts each load late (the only fake: a slow disk on demand)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from himamba.tiers.adapter_health import create_lmcache_adapter
from himamba.tiers.lmcache_store import LMCacheStore, TaskResult
from himamba.tiers.object_format import LayoutFingerprint, Namespace, ObjectKind, StorageKey
from himamba.tiers.storage_config import StorageConfig
from tests.harness.redis_server import RedisServer
from tests.harness.s3_server import S3Server

KV, MAMBA = ObjectKind.KV, ObjectKind.MAMBA
FP = LayoutFingerprint(16, "bfloat16", (4, 2, 16, 2, 64), ("float32",), ((4, 8, 64),), 0, 1, "NHD")


def ns(model: str = "org/model-a", **kw) -> Namespace:
    return Namespace(model, LayoutFingerprint(**{**FP.__dict__, **kw}))


def h(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes, like vLLM's sha256 block hashes


def payload(i: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def make_store(where: str | dict, namespace: Namespace | None = None, **cfg) -> LMCacheStore:
    d = {"adapter": where} if isinstance(where, dict) else {"url": where}
    d.setdefault("op_deadline_s", 3.0)
    return LMCacheStore(StorageConfig.from_dict({**d, **cfg}), namespace or ns())


def run(store: LMCacheStore, tid: int, timeout: float = 10.0) -> TaskResult:
    r = store.wait(tid, timeout)
    assert r is not None, "task never finished"
    return r


def eventually(cond: Callable[[], bool], timeout: float = 8.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def file_of(directory: Path, store: LMCacheStore, key: StorageKey) -> Path:
    """fs/fs_native name: the Redis key with a 0x-prefixed rank and a .data suffix."""
    tag, rank, rest = store.object_key_string(key).split("@", 2)
    return directory / f"{tag}@0x{rank}@{rest}.data"


def corrupt(where_obj, store: LMCacheStore, key: StorageKey, mutate: Callable[[bytes], bytes]):
    if isinstance(where_obj, RedisServer):
        c, name = where_obj.client(), store.object_key_string(key)
        c.set(name, mutate(c.get(name)))
    elif isinstance(where_obj, S3Server):
        name = store.object_key_string(key)
        where_obj.put_object(name, mutate(where_obj.get_object(name)))
    else:
        f = file_of(where_obj, store, key)
        f.write_bytes(mutate(f.read_bytes()))


def exists_in_backend(where_obj, store: LMCacheStore, key: StorageKey) -> bool:
    if isinstance(where_obj, RedisServer):
        return bool(where_obj.client().exists(store.object_key_string(key)))
    if isinstance(where_obj, S3Server):
        return where_obj.has_object(store.object_key_string(key))
    return file_of(where_obj, store, key).exists()


def store_reading_late(storage_dir: Path, delay_s: float, op_deadline_s: float = 10.0):
    """A real fs_native adapter that starts each load `delay_s` after it was asked to (a slow
    disk or network on demand): its bytes land in the destination after that, whatever the
    caller did meanwhile, and its answer comes only then."""

    def factory(spec):
        ad = create_lmcache_adapter(spec)
        submit, query = ad.submit_load_task, ad.query_load_result
        ids, real = itertools.count(1 << 40), {}

        def submit_load_task(keys, objs):
            mine = next(ids)

            def later() -> None:
                time.sleep(delay_s)
                real[mine] = submit(keys, objs)

            threading.Thread(target=later, daemon=True).start()
            return mine

        def query_load_result(mine):
            return query(real[mine]) if mine in real else None

        ad.submit_load_task, ad.query_load_result = submit_load_task, query_load_result
        return ad

    cfg = {"url": f"file://{storage_dir}", "op_deadline_s": op_deadline_s}
    return LMCacheStore(StorageConfig.from_dict(cfg), ns(), adapter_factory=factory)
