"""Hits count loads, not lookups: a request that the scheduler asks about again (a pending
storage probe, a preemption) locks its hit each time, but only its first lock is a new use, so
only that one may move the path toward selective write-through's threshold."""

from __future__ import annotations

from himamba.connector.tree import HybridRadixTree, check_invariants
from tests.unit.tree.tree_helpers import chain, hit_count, store


def test_relocking_the_same_request_does_not_count_as_another_hit() -> None:
    tree = HybridRadixTree(8, 2)
    h = chain("abc")
    store(tree, h, states=(3,))
    first = tree.lock(tree.match(h), count_hit=True)
    assert first is not None
    tree.unlock(first)
    for _ in range(5):  # the same request, retried
        handle = tree.lock(tree.match(h), count_hit=False)
        assert handle is not None
        tree.unlock(handle)
    assert hit_count(tree, h, None, 2) == 1
    handle = tree.lock(tree.match(h))  # counting is the default
    assert handle is not None
    tree.unlock(handle)
    assert hit_count(tree, h, None, 0) == 2
    check_invariants(tree)


def test_retried_lookups_never_make_a_path_hot() -> None:
    tree = HybridRadixTree(8, 2)
    h = chain("abcd")
    store(tree, h, states=(4,))
    res = tree.match(h)
    handle = tree.lock(res, host_only=True)  # the request's first load
    assert tree.hot_objects(res, 2) == []
    tree.unlock(handle)
    for _ in range(3):  # asked again: still its one use of the prefix
        res = tree.match(h)
        handle = tree.lock(res, host_only=True, count_hit=False)
        assert tree.hot_objects(res, 2) == []
        tree.unlock(handle)
    res = tree.match(h)
    handle = tree.lock(res, host_only=True)  # a second request: now it is hot
    assert len(tree.hot_objects(res, 2)) == 5  # four blocks and the state
    tree.unlock(handle)
    check_invariants(tree)
