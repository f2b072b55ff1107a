"""Storage health: breaker back-off (pure, injectable clock) and the scheduler's slow-wait
reports against a real fs directory and a real redis-server."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lmcache")
pytest_plugins = ("tests.harness.redis_server",)  # redis_server, storage_dir

from himamba.tiers.circuit_breaker import BreakerState, CircuitBreaker  # noqa: E402
from himamba.tiers.lmcache_store import LMCacheStore, create_lmcache_adapter  # noqa: E402
from himamba.tiers.object_format import StorageKey  # noqa: E402
from himamba.tiers.storage_config import StorageConfig  # noqa: E402
from himamba.tiers.storage_records import TaskError  # noqa: E402
from tests.harness.redis_server import RedisServer  # noqa: E402
from tests.harness.stores import KV, eventually, h, make_store, ns, payload, run  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def recover(b: CircuitBreaker, clock: Clock) -> None:
    clock.t += b.cooldown_s
    assert b.should_probe()
    b.probe_result(True)
    assert b.state is BreakerState.CLOSED


def test_breaker_reopen_without_healthy_period_doubles_cooldown_up_to_cap():
    clock = Clock()
    b = CircuitBreaker(failures=2, cooldown_s=1.0, max_cooldown_s=5.0, clock=clock)
    b.record_failure()
    assert b.record_failure() and b.cooldown_s == 1.0  # first trip: base cool-down
    clock.t += 0.9
    assert not b.should_probe(), "still cooling down"
    clock.t += 0.1
    assert b.should_probe() and b.state is BreakerState.PROBING
    b.probe_result(False)  # a failed probe is a re-open
    assert b.state is BreakerState.OPEN and b.cooldown_s == 2.0
    recover(b, clock)
    seen = []
    for _ in range(4):  # trips soon after each recovery: storage flaps
        clock.t += 1.0
        b.record_failure()
        assert b.record_failure()
        seen.append(b.cooldown_s)
        recover(b, clock)
    assert seen == [4.0, 5.0, 5.0, 5.0]
    assert b.opens == 5


def test_breaker_healthy_period_resets_cooldown_to_base():
    clock = Clock()
    b = CircuitBreaker(failures=1, cooldown_s=1.0, max_cooldown_s=8.0, clock=clock)
    b.trip("down")
    clock.t += 1.0
    assert b.should_probe()
    b.probe_result(False)
    assert b.cooldown_s == 2.0
    recover(b, clock)
    clock.t += 7.9  # closed, but not for a full healthy period (= max cool-down)
    assert b.record_failure() and b.cooldown_s == 4.0
    recover(b, clock)
    clock.t += 8.5  # a full healthy period closed: the next trip is a fresh one
    assert b.record_failure() and b.cooldown_s == 1.0


def test_breaker_success_resets_failure_streak_only_while_closed():
    clock = Clock()
    b = CircuitBreaker(failures=3, cooldown_s=1.0, clock=clock)
    assert not b.record_failure() and not b.record_failure()
    b.record_success()
    assert not b.record_failure() and not b.record_failure() and b.allow()
    assert b.record_failure() and not b.allow()
    b.record_success()  # a late success of an op sent before the trip changes nothing
    assert b.state is BreakerState.OPEN and not b.record_failure()


def test_breaker_config_defaults_and_cap_follow_the_base_cooldown():
    c = StorageConfig.from_dict({"url": "/x"})
    assert (c.write_buffer_mb, c.breaker_max_cooldown_s, c.adapter_put_depth) == (256, 60.0, 4)
    assert (
        StorageConfig.from_dict({"url": "/x", "breaker_cooldown_s": 90}).breaker_max_cooldown_s
        == 90
    )


def test_report_slow_opens_breaker_then_health_probe_closes_it(storage_dir: Path):
    s = make_store(
        f"file://{storage_dir}", breaker_failures=3, breaker_cooldown_s=0.3, probe_interval_s=3600
    )
    try:
        k, d = StorageKey(h(1), KV), payload(1, 4096)
        assert run(s, s.submit_put([k], [d])).ok == (True,)
        s.report_slow("probe wait timed out")
        s.report_slow("probe wait timed out")
        assert eventually(lambda: s.stats.slow_reports == 2)
        assert s.breaker_state is BreakerState.CLOSED, "fewer than breaker_failures reports"
        s.report_slow("fetch wait timed out")
        assert eventually(lambda: s.breaker_state is not BreakerState.CLOSED, 2)
        assert s.stats.breaker_opens == 1
        t0 = time.monotonic()
        r = run(s, s.submit_exists([k]))  # requests stop waiting: an immediate miss
        assert (r.ok, r.error) == ((False,), TaskError.BREAKER_OPEN)
        assert time.monotonic() - t0 < 0.25
        assert eventually(lambda: s.breaker_state is BreakerState.CLOSED, 5)
        assert s.stats.probes_ok >= 1 and s.stats.adapter_recreations == 1
        dst = torch.zeros_like(d)
        assert run(s, s.submit_get([k], [dst])).ok == (True,) and torch.equal(dst, d)
    finally:
        s.close()


def test_late_success_does_not_break_a_streak_of_slow_waits(redis_server: RedisServer):
    """Slow-but-alive storage answers every op, just too late for the waiting request; those
    answers must not reset the slow streak, while a timely one does."""
    s = make_store(
        redis_server.url,
        breaker_failures=2,
        op_deadline_s=5.0,
        prefetch_timeout_base_s=0.3,  # the shortest wait a request spends on storage
        probe_interval_s=3600,
    )
    try:
        k, d = StorageKey(h(2), KV), payload(2, 4096)
        assert run(s, s.submit_put([k], [d])).ok == (True,)
        s.report_slow("wait timed out")
        assert eventually(lambda: s.stats.slow_reports == 1)
        assert run(s, s.submit_exists([k])).ok == (True,)  # timely: the streak restarts
        s.report_slow("wait timed out")
        assert eventually(lambda: s.stats.slow_reports == 2)
        time.sleep(0.1)
        assert s.breaker_state is BreakerState.CLOSED
        redis_server.pause()
        tid = s.submit_exists([k])
        time.sleep(0.6)
        redis_server.resume()
        r = run(s, tid)
        assert (r.ok, r.error) == ((True,), None)  # it did answer, just late
        s.report_slow("wait timed out")
        assert eventually(lambda: s.breaker_state is not BreakerState.CLOSED, 2)
    finally:
        s.close()


def test_slow_wait_verdict_counts_at_once_while_the_driver_is_stuck_in_a_slow_call(
    storage_dir: Path,
):
    """Storage whose adapter calls themselves block (a hung mount): the scheduler's timed-out
    waits must open the breaker immediately, not once the driver thread gets free, or every
    request in the meantime waits its full deadline too."""

    def slow_factory(spec: dict) -> object:
        adapter = create_lmcache_adapter(spec)
        submit = adapter.submit_lookup_and_lock_task

        def stuck(*a, **kw):
            time.sleep(2.0)
            return submit(*a, **kw)

        adapter.submit_lookup_and_lock_task = stuck
        return adapter

    cfg = StorageConfig.from_dict(
        {"url": f"file://{storage_dir}", "breaker_failures": 2, "probe_interval_s": 3600}
    )
    s = LMCacheStore(cfg, ns(), adapter_factory=slow_factory)
    try:
        first = s.submit_exists([StorageKey(h(3), KV)])  # the driver is now stuck for 2 s
        time.sleep(0.1)
        s.report_slow("wait timed out")
        s.report_slow("wait timed out")
        assert s.breaker_state is BreakerState.OPEN and s.stats.breaker_opens == 1
        t0 = time.monotonic()
        r = run(s, s.submit_exists([StorageKey(h(4), KV)]))
        assert r.error is TaskError.BREAKER_OPEN and time.monotonic() - t0 < 0.25
        assert run(s, first).ok == (False,)  # the stuck call still ends, as a miss
    finally:
        s.close()


def test_a_refused_redis_write_replaces_the_connection_it_desynchronised(
    redis_server: RedisServer,
):
    """Redis at `maxmemory` with `noeviction` refuses a SET with an error line; LMCache's RESP
    client reads five bytes of it and leaves the rest on that connection, where it would be
    read as the reply to that worker's next command (a miss or a failed store, for good). One
    refused write replaces the adapter, so once memory is free every read hits again."""
    s = make_store(redis_server.url, breaker_cooldown_s=0.2, probe_interval_s=3600)
    try:
        keys = [StorageKey(h(i), KV) for i in range(16)]
        data = [payload(i, 65536) for i in range(16)]
        assert run(s, s.submit_put(keys, data)).ok == (True,) * 16
        redis = redis_server.client()
        used = int(redis.info("memory")["used_memory"])
        redis.config_set("maxmemory-policy", "noeviction")
        redis.config_set("maxmemory", str(used + 32768))  # no room for one more object
        big = StorageKey(h(99), KV)
        assert run(s, s.submit_put([big], [payload(99, 65536)])).ok == (False,)
        assert s.stats.breaker_opens == 1  # the first refusal, not a streak of them
        redis.config_set("maxmemory", "0")
        assert eventually(lambda: s.breaker_state is BreakerState.CLOSED)
        assert s.stats.adapter_recreations == 1
        for k, d in zip(keys, data, strict=True):  # one by one: each may go to any worker
            dst = torch.zeros_like(d)
            assert run(s, s.submit_get([k], [dst])).ok == (True,) and torch.equal(dst, d)
    finally:
        s.close()
