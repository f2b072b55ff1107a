"""`LMCacheStore` is a `ByteStore`: every member the connector may use exists with the
contract's parameters, and a task's failure is a `TaskError` member, compared by identity."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from himamba.tiers.byte_store import ByteStore
from himamba.tiers.storage_records import TaskError


def _members() -> list[str]:
    return [
        n
        for n, v in vars(ByteStore).items()
        if not n.startswith("_") and (callable(v) or isinstance(v, property))
    ]


def test_lmcache_store_has_every_byte_store_member_with_the_same_parameters():
    pytest.importorskip("lmcache")
    from himamba.tiers.lmcache_store import LMCacheStore

    assert {"submit_put", "poll", "take_released", "breaker_state", "stats"} <= set(_members())
    for name in _members():
        want = getattr(ByteStore, name)
        if isinstance(want, property):  # `stats` is a plain attribute of the store
            assert name == "stats" or isinstance(getattr(LMCacheStore, name), property), name
            continue
        got = inspect.signature(getattr(LMCacheStore, name))
        assert list(got.parameters) == list(inspect.signature(want).parameters), name
        for p in got.parameters.values():
            expected = inspect.signature(want).parameters[p.name].default
            assert p.default == expected, f"{name}({p.name})"


def test_an_open_store_passes_the_runtime_protocol_check(tmp_path: Path):
    pytest.importorskip("lmcache")
    from tests.harness.stores import make_store

    store: ByteStore = make_store(str(tmp_path), probe_interval_s=3600)
    try:
        assert isinstance(store, ByteStore)
    finally:
        store.close()


def test_task_errors_compare_by_member_and_print_their_value():
    assert TaskError.BACKPRESSURE != "backpressure"  # a string never matches by accident
    assert TaskError("backpressure") is TaskError.BACKPRESSURE
    assert str(TaskError.BACKPRESSURE) == "backpressure"
    assert f"{TaskError.DEADLINE}" == "deadline"
    assert len({e.value for e in TaskError}) == len(TaskError)
