"""Gets into lent `ObjectView`s: the adapter reads an object straight into the caller's memory
(a host slot), the store checks it there, and memory the adapter may still write into after the
task was reported (a cancel, a deadline, a close) is announced when the adapter let go of it.
Real fs_native adapter in a directory; the only fake is a delay before a load starts."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lmcache")
pytest_plugins = ("tests.harness.redis_server",)  # storage_dir

from himamba.tiers.object_format import HEADER_SIZE, StorageKey  # noqa: E402
from himamba.tiers.staging import ObjectView  # noqa: E402
from himamba.tiers.storage_records import TaskError  # noqa: E402
from tests.harness.stores import (  # noqa: E402
    KV,
    MAMBA,
    corrupt,
    eventually,
    h,
    make_store,
    payload,
    run,
    store_reading_late,  # noqa: E402
)


def test_a_lent_view_receives_the_object_in_place_and_is_checked_there(storage_dir: Path):
    s = make_store(f"file://{storage_dir}")
    try:
        keys = [StorageKey(h(400 + i), KV) for i in range(3)] + [StorageKey(h(410), MAMBA)]
        data = [payload(400 + i, 8192) for i in range(3)] + [payload(410, 4096)]
        assert run(s, s.submit_put(keys, data)).ok == (True,) * 4
        corrupt(storage_dir, s, keys[1], lambda b: b[:-1] + bytes([b[-1] ^ 1]))
        views = [np.zeros(HEADER_SIZE + 8192, np.uint8) for _ in range(3)]
        plain = np.zeros(4096, np.uint8)  # lent and staged destinations mix in one task
        r = run(s, s.submit_get(keys, [*(ObjectView(v) for v in views), plain]))
        assert r.ok == (True, False, True, True) and r.error is None and not r.held
        for i in (0, 2):
            assert np.array_equal(views[i][HEADER_SIZE:], data[i].numpy())
        assert np.array_equal(plain, data[3].numpy())
        assert s.stats.invalid == {"checksum": 1}
        assert s.take_released() == []  # nothing was held past its result
        with pytest.raises(ValueError, match="writable"):
            ObjectView(np.frombuffer(b"x" * 8, np.uint8))
    finally:
        s.close()


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_view_the_adapter_still_writes_is_held_until_it_answers(storage_dir: Path, how: str):
    """The store cannot take a raw pointer back from a native adapter: a get given up while
    the adapter reads is reported `held`, the late bytes do land in the view, and only once
    the adapter answered does its id come back from `take_released`."""
    s = store_reading_late(storage_dir, 0.6, op_deadline_s=10.0 if how == "cancel" else 0.2)
    try:
        k, d = StorageKey(h(420), KV), payload(420, 16384)
        assert run(s, s.submit_put([k], [d])).ok == (True,)
        view = np.zeros(HEADER_SIZE + 16384, np.uint8)
        tid = s.submit_get([k], [ObjectView(view)])
        time.sleep(0.1)
        if how == "cancel":
            assert s.cancel(tid) is True
        r = run(s, tid)
        assert r.held and r.ok == (False,)
        assert r.error is (TaskError.CANCELLED if how == "cancel" else TaskError.DEADLINE)
        assert s.take_released() == [] and s.cancel(tid) is True  # still held
        assert eventually(lambda: view[HEADER_SIZE:].any(), 5)  # the late write did land
        released: list[int] = []
        assert eventually(lambda: bool(released.extend(s.take_released()) or released), 5)
        assert released == [tid] and s.cancel(tid) is False
    finally:
        s.close()


def test_closing_the_store_releases_what_its_adapter_held(storage_dir: Path):
    s = store_reading_late(storage_dir, 0.5)
    k, d = StorageKey(h(430), KV), payload(430, 4096)
    assert run(s, s.submit_put([k], [d])).ok == (True,)
    tid = s.submit_get([k], [ObjectView(np.zeros(HEADER_SIZE + 4096, np.uint8))])
    time.sleep(0.1)
    assert s.cancel(tid) is True
    s.close()
    assert s.take_released() == [tid]
