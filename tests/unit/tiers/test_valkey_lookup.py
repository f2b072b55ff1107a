"""Storage probes through the cluster adapter go as one pipelined batch and answer exactly as
LMCache's one-EXISTS-per-key path does, including during a partial outage (a real 3-node
Redis Cluster; only the "unknown adapter" case uses a stand-in, as a fault)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness.redis_cluster import running_cluster

pytest.importorskip("lmcache")


def _lookup(adapter: Any, keys: list[Any], timeout_s: float = 20.0) -> list[bool]:
    """The lookup's answer, polled against a clock: the adapter's event fd stays readable once
    an earlier lookup fired it (nobody reads it here), so counting waits on it is no timeout;
    a lookup that reaches a node just killed waits for the client's request timeout."""
    tid = adapter.submit_lookup_and_lock_task(keys, {})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        bm = adapter.query_lookup_and_lock_result(tid)
        if bm is not None:
            hits = set(bm.get_indices_list())
            adapter.submit_unlock([k for i, k in enumerate(keys) if i in hits])
            return [i in hits for i in range(len(keys))]
        time.sleep(0.005)
    raise AssertionError(f"the lookup never finished in {timeout_s} s")


def _adapters(url: str) -> tuple[Any, Any]:
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

    from himamba.tiers.adapter_health import create_lmcache_adapter
    from himamba.tiers.cluster_url import cluster_adapter_spec

    spec = cluster_adapter_spec(url)
    batched = create_lmcache_adapter(spec)
    per_key = create_l2_adapter_from_registry(get_l2_adapter_config_class("valkey").from_dict(spec))
    return batched, per_key


def test_a_probe_is_one_batch_and_answers_like_the_per_key_path_also_with_a_node_down(
    tmp_path: Path,
):
    from lmcache.v1.distributed.api import ObjectKey

    with running_cluster(tmp_path / "cluster") as cluster:
        batched, per_key = _adapters(cluster.url)
        try:
            keys = [ObjectKey(os.urandom(16), "m", 0) for _ in range(60)]
            present = set(range(0, 60, 3))
            client = batched._pool._get_client()
            for i in present:
                client.set(batched._wire_key(keys[i]).encode(), b"x")
            # One job on the adapter's pool for the whole probe, not one per key.
            executor = batched._pool._executor
            real_submit, jobs = executor.submit, []
            executor.submit = lambda *a, **kw: jobs.append(a) or real_submit(*a, **kw)
            want = [i in present for i in range(60)]
            assert _lookup(batched, keys) == want
            assert len(jobs) == 1
            assert _lookup(per_key, keys) == want
            # A node down: its keys miss, every other key answers as before.
            down = cluster.node_of(batched._wire_key(keys[0]))
            cluster.kill(down)
            live = [i in present and cluster.node_of(batched._wire_key(k)) != down
                    for i, k in enumerate(keys)]  # fmt: skip
            assert any(live) and live != want
            assert _lookup(batched, keys) == live
            cluster.restart(down)
        finally:
            batched.close()
            per_key.close()


def test_an_adapter_it_does_not_know_is_left_as_it_is(caplog):
    from himamba.tiers.valkey_lookup import batch_lookups

    class ValkeyL2Adapter:  # a different LMCache's adapter: no pool of its own
        def submit_lookup_and_lock_task(self, keys, layout):
            return 7

    adapter = ValkeyL2Adapter()
    with caplog.at_level("WARNING"):
        assert not batch_lookups(adapter)
    assert "_pool" in caplog.text
    assert adapter.submit_lookup_and_lock_task([], {}) == 7
    assert not batch_lookups(object())  # not a valkey adapter at all: nothing said
