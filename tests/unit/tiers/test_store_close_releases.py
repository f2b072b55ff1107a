"""Closing a store never loses a view the adapter held: every task reported `held` comes back
from `take_released()` exactly once, also when what frees its views (an old adapter finally
closed, a CPU worker's validation) arrives while the store closes or after. Real fs_native
adapters in a directory; the only fakes are delays around their calls."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("lmcache")
pytest_plugins = ("tests.harness.redis_server",)  # storage_dir

from himamba.tiers import get_path, lmcache_store  # noqa: E402
from himamba.tiers.adapter_health import create_lmcache_adapter  # noqa: E402
from himamba.tiers.lmcache_store import LMCacheStore  # noqa: E402
from himamba.tiers.object_format import HEADER_SIZE, StorageKey  # noqa: E402
from himamba.tiers.staging import ObjectView  # noqa: E402
from himamba.tiers.storage_config import StorageConfig  # noqa: E402
from himamba.tiers.storage_records import TaskError  # noqa: E402
from tests.harness.stores import KV, eventually, h, make_store, ns, payload, run  # noqa: E402


def slow_reading_adapter(spec: dict[str, Any], delay_s: float) -> Any:
    """A real fs_native adapter whose loads start `delay_s` late, and whose close, like a real
    adapter's, returns only once the I/O it was given has been issued."""
    ad = create_lmcache_adapter(spec)
    submit, query, close = ad.submit_load_task, ad.query_load_result, ad.close
    late: list[threading.Thread] = []
    real: dict[int, int] = {}
    ids = iter(range(1 << 40, 1 << 41))

    def submit_load_task(keys: list, objs: list) -> int:
        mine = next(ids)

        def later() -> None:
            time.sleep(delay_s)
            real[mine] = submit(keys, objs)

        t = threading.Thread(target=later, daemon=True)
        late.append(t)
        t.start()
        return mine

    def query_load_result(mine: int) -> Any:
        return query(real[mine]) if mine in real else None

    def slow_close() -> None:
        for t in late:
            t.join()
        close()

    ad.submit_load_task, ad.query_load_result, ad.close = (
        submit_load_task,
        query_load_result,
        slow_close,
    )
    return ad


def flaky_store(storage_dir: Path, delay_s: float) -> LMCacheStore:
    """One slow wait opens the breaker; 0.1 s later the adapter is replaced."""
    cfg = StorageConfig.from_dict(
        {
            "url": f"file://{storage_dir}",
            "op_deadline_s": 10.0,
            "breaker_failures": 1,
            "breaker_cooldown_s": 0.1,
            "probe_interval_s": 3600,
        }
    )
    return LMCacheStore(cfg, ns(), adapter_factory=lambda s: slow_reading_adapter(s, delay_s))


def lend_a_get_then_replace_the_adapter(s: LMCacheStore, i: int) -> int:
    """A get into a lent view, still with the adapter when the adapter is replaced."""
    k, d = StorageKey(h(i), KV), payload(i, 4096)
    assert run(s, s.submit_put([k], [d])).ok == (True,)
    tid = s.submit_get([k], [ObjectView(np.zeros(HEADER_SIZE + 4096, np.uint8))])
    time.sleep(0.05)
    s.report_slow("a request's wait timed out")
    r = run(s, tid)
    assert r.error is TaskError.ADAPTER_RECREATED and r.held
    return tid


def test_views_quarantined_by_a_replaced_adapter_are_released_when_the_store_closes_first(
    storage_dir: Path,
):
    """The replaced adapter finishes closing only after the store's close began: the free it
    posts must still run, so the view comes back by the time close() returns."""
    s = flaky_store(storage_dir, delay_s=0.8)
    tid = lend_a_get_then_replace_the_adapter(s, 1)
    assert s.quarantined_buffers() == 1 and s.take_released() == []
    s.close()
    assert s.take_released() == [tid]
    assert s.quarantined_buffers() == 0


def test_an_old_adapter_slower_to_close_than_the_store_stays_counted_then_is_released(
    storage_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """close() does not wait forever for a replaced adapter: what it still holds stays counted
    as quarantined after close, and is released once that adapter is closed."""
    monkeypatch.setattr(lmcache_store, "_OLD_ADAPTERS_CLOSE_S", 0.05)
    s = flaky_store(storage_dir, delay_s=1.0)
    tid = lend_a_get_then_replace_the_adapter(s, 2)
    s.close()
    assert s.quarantined_buffers() == 1 and s.take_released() == []
    released: list[int] = []
    assert eventually(lambda: bool(released.extend(s.take_released()) or released), 5)
    assert released == [tid] and s.quarantined_buffers() == 0


def test_a_validation_finishing_while_the_store_closes_still_completes_its_get(
    storage_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """The adapter answered and a CPU worker is checking the object when close() begins: its
    result is posted after the driver stopped, and must still finish the task and give the
    lent view back (not leave it reported `held` with no release ever coming)."""
    checking, real_validate = threading.Event(), get_path.validate_object

    def slow_validate(*a: Any, **kw: Any) -> str | None:  # a CPU-starved box, on demand
        checking.set()
        time.sleep(0.5)
        return real_validate(*a, **kw)

    monkeypatch.setattr(get_path, "validate_object", slow_validate)
    s = make_store(f"file://{storage_dir}", probe_interval_s=3600)
    k, d = StorageKey(h(3), KV), payload(3, 4096)
    assert run(s, s.submit_put([k], [d])).ok == (True,)
    view = np.zeros(HEADER_SIZE + 4096, np.uint8)
    tid = s.submit_get([k], [ObjectView(view)])
    assert checking.wait(5)
    s.close()
    r = s.wait(tid, 0)
    assert r is not None and (r.ok, r.error, r.held) == ((True,), None, False)
    assert np.array_equal(view[HEADER_SIZE:], d.numpy())
    assert s.take_released() == []


def test_every_held_task_is_released_exactly_once_across_polls(storage_dir: Path):
    """Releases land at any moment relative to the caller's poll / take_released rounds (here
    mostly between a poll and the next take_released); none is lost or repeated."""
    from tests.harness.stores import store_reading_late

    s = store_reading_late(storage_dir, 0.6)
    try:
        keys = [StorageKey(h(10 + i), KV) for i in range(6)]
        assert (
            run(s, s.submit_put(keys, [payload(10 + i, 4096) for i in range(6)])).ok == (True,) * 6
        )
        tids = []
        for i, k in enumerate(keys):
            tids.append(s.submit_get([k], [ObjectView(np.zeros(HEADER_SIZE + 4096, np.uint8))]))
            time.sleep(0.03 * (i % 3))  # their answers (and releases) come staggered too
        assert all(s.cancel(t) for t in tids)
        held, released = set(), Counter()
        end = time.monotonic() + 5
        while time.monotonic() < end and (len(held) < 6 or set(released) != held):
            held |= {r.task_id for r in s.poll() if r.held}
            time.sleep(0.03)  # releases arrive here, between the poll and the take
            released.update(s.take_released())
        assert held == set(tids) and set(released) == held
        assert all(n == 1 for n in released.values())
        time.sleep(0.4)
        assert s.take_released() == [] and s.poll() == []
    finally:
        s.close()
    assert s.take_released() == []
