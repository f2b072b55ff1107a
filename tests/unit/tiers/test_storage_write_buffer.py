"""The store's write path: one copy at submission, bounded put memory, deadlines that time the
backend (not a queue in front of it). Real fs directory and real redis-server."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lmcache")
pytest_plugins = ("tests.harness.redis_server",)  # redis_server, storage_dir

from himamba.tiers.circuit_breaker import BreakerState  # noqa: E402
from himamba.tiers.object_format import HEADER_SIZE, StorageKey  # noqa: E402
from himamba.tiers.storage_records import TaskError  # noqa: E402
from tests.harness.redis_server import RedisServer  # noqa: E402
from tests.harness.stores import KV, MAMBA, eventually, h, make_store, payload, run  # noqa: E402


def test_put_copies_payload_and_segments_so_caller_may_reuse_them_at_once(storage_dir: Path):
    s = make_store(f"file://{storage_dir}")
    try:
        whole, parts = payload(1, 40000), [payload(2, 1000), payload(3, 30000), payload(4, 9000)]
        parts[1] = parts[1].view(torch.int16)  # any dtype: stored as its bytes
        nbytes = [p.numel() * p.element_size() for p in parts]
        expected = torch.cat([p.view(torch.uint8) for p in parts])
        keys = [StorageKey(h(1), KV), StorageKey(h(1), MAMBA)]
        tid = s.submit_put(keys, [whole, [p.numpy() for p in parts]])
        original = whole.clone()
        whole.zero_()  # the caller reuses its memory right after submit returns
        for p in parts:
            p.zero_()
        assert run(s, tid).ok == (True, True)
        dsts = [torch.zeros(40000, dtype=torch.uint8), torch.zeros(sum(nbytes), dtype=torch.uint8)]
        assert run(s, s.submit_get(keys, dsts)).ok == (True, True)
        assert torch.equal(dsts[0], original) and torch.equal(dsts[1], expected)
        assert s.metrics()["write_buffer_bytes"] == 0, "completed puts release the write buffer"
    finally:
        s.close()


def test_stalled_redis_bounds_put_memory_skips_puts_and_recovers_after_resume(
    redis_server: RedisServer,
):
    limit_mb, obj = 2, 256 << 10
    s = make_store(
        redis_server.url,
        write_buffer_mb=limit_mb,
        op_deadline_s=1.0,
        breaker_failures=2,
        breaker_cooldown_s=0.3,
        breaker_max_cooldown_s=1.0,
        probe_interval_s=0.3,
    )
    d = payload(1, obj)
    try:
        k0 = StorageKey(h(0), KV)
        assert run(s, s.submit_put([k0], [d])).ok == (True,)
        redis_server.pause()
        try:
            tids = [s.submit_put([StorageKey(h(100 + i), KV)], [d]) for i in range(40)]
            fit = (limit_mb << 20) // (obj + HEADER_SIZE)  # puts the write buffer can hold
            dst = torch.zeros_like(d)
            get = s.submit_get([k0], [dst])  # reads are never refused for lack of room
            results = [run(s, t) for t in tids]
            skipped = [r for r in results if r.error is TaskError.BACKPRESSURE]
            assert len(skipped) == 40 - fit and s.stats.puts_skipped == 40 - fit
            assert all(r.ok == (False,) for r in results), "nothing can be stored while stalled"
            assert run(s, get).error in (TaskError.DEADLINE, TaskError.ADAPTER_RECREATED)
            m = s.metrics()
            assert 0 < m["write_buffer_peak_bytes"] <= limit_mb << 20
            assert m["write_buffer_bytes"] <= limit_mb << 20
            assert s.stats.breaker_opens >= 1  # the stall itself is a failure: deadlines
        finally:
            redis_server.resume()
        assert eventually(lambda: s.breaker_state is BreakerState.CLOSED, 10)
        assert eventually(lambda: s.metrics()["write_buffer_bytes"] == 0)
        k = StorageKey(h(7), KV)
        assert run(s, s.submit_put([k], [d])).ok == (True,)
        dst = torch.zeros_like(d)
        assert run(s, s.submit_get([k], [dst])).ok == (True,) and torch.equal(dst, d)
    finally:
        s.close()


def test_checksum_backlog_on_healthy_fs_never_expires_or_opens_breaker(
    storage_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """Sealing (header + checksum) is slowed the way a CPU-starved box slows it: the backlog
    in front of the adapter lasts several op deadlines while each adapter call takes a
    fraction of one. A deadline that started at submission expired the tail of the burst and
    opened the breaker on healthy storage; it must time the adapter only."""
    import himamba.tiers.put_path as put_path

    real_seal = put_path.seal_object

    def slow_seal(*args, **kwargs) -> None:  # fault injection: a real CPU cannot be starved
        time.sleep(0.02)  # on demand, reproducibly
        real_seal(*args, **kwargs)

    monkeypatch.setattr(put_path, "seal_object", slow_seal)
    deadline, n = 0.3, 64
    s = make_store(
        f"file://{storage_dir}",
        op_deadline_s=deadline,
        breaker_failures=2,
        num_workers=1,
        probe_interval_s=3600,
    )
    try:
        objs = [payload(i, 1 << 20) for i in range(n)]
        t0 = time.monotonic()
        tids = [s.submit_put([StorageKey(h(i), KV)], [objs[i]]) for i in range(n)]
        results = [run(s, t, 30) for t in tids]
        assert time.monotonic() - t0 > 3 * deadline  # the backlog really outlasted deadlines
        assert [r.error for r in results] == [None] * n
        assert all(r.ok == (True,) for r in results)
        assert s.stats.deadline_expired == 0 and s.stats.breaker_opens == 0
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        assert run(s, s.submit_get([StorageKey(h(n - 1), KV)], [dst])).ok == (True,)
        assert torch.equal(dst, objs[n - 1])
    finally:
        s.close()


def test_burst_of_big_puts_on_healthy_fs_completes_without_expiry(storage_dir: Path):
    """Real bytes, real disk: a burst far larger than the adapter takes at once goes through
    the put queue (adapter_put_depth) with no deadline expiring on the way."""
    n, size = 128, 4 << 20
    s = make_store(
        f"file://{storage_dir}",
        op_deadline_s=0.4,
        breaker_failures=2,
        write_buffer_mb=1024,
        probe_interval_s=3600,
    )
    try:
        objs = [payload(i, size) for i in range(8)]
        tids = [s.submit_put([StorageKey(h(i), KV)], [objs[i % 8]]) for i in range(n)]
        results = [run(s, t, 60) for t in tids]
        assert [r.error for r in results] == [None] * n
        assert s.stats.deadline_expired == 0 and s.stats.breaker_opens == 0
        assert s.stats.put_objects == n and s.stats.puts_skipped == 0
        dst = torch.zeros(size, dtype=torch.uint8)
        assert run(s, s.submit_get([StorageKey(h(n - 1), KV)], [dst])).ok == (True,)
        assert torch.equal(dst, objs[(n - 1) % 8])
    finally:
        s.close()
