"""The host LRUs are lazy (a hit only stamps its path; eviction re-queues what was touched):
eviction must still take exactly the least recently used host leaf, from its end, and the
heaps must stay bounded however many hits and evictions come."""

from __future__ import annotations

import hashlib
import random

from himamba.connector.tree import HOST, HybridRadixTree, check_invariants
from tests.unit.tree.tree_helpers import evict_host, evict_host_mamba


def _conv(tag: bytes, n: int) -> list[bytes]:
    """``n`` chained block hashes, as vLLM makes them."""
    out, prev = [], tag
    for _ in range(n):
        prev = hashlib.blake2b(prev, digest_size=16).digest()
        out.append(prev)
    return out


def _store(
    tree: HybridRadixTree,
    hashes: list[bytes],
    state_ends: tuple[int, ...],
    from_device: bool = True,
) -> None:
    """Store every block of ``hashes`` on host, and a state at each of ``state_ends``."""
    kv = [
        s
        for i in range(len(hashes))
        if (s := tree.reserve_kv(hashes, None, i, from_device)) is not None
    ]
    states = [
        s for e in state_ends if (s := tree.reserve_mamba(hashes, None, e, from_device)) is not None
    ]
    tree.complete_store(kv, states)


def _on_host(tree: HybridRadixTree, hashes: list[bytes]) -> list[int]:
    """Indices of the blocks of ``hashes`` held on host (read without touching any LRU)."""
    out = []
    for i in range(len(hashes)):
        found = tree.forest.locate(hashes, None, i + 1)
        if found is not None and found[0].flags[found[1]] & HOST:
            out.append(i)
    return out


def test_hit_makes_its_conversation_the_last_host_eviction_victim() -> None:
    tree = HybridRadixTree(12, 8)
    a, b, c = _conv(b"a", 4), _conv(b"b", 4), _conv(b"c", 4)
    for hs in (a, b, c):
        _store(tree, hs, (4,))
    assert tree.match(a).num_blocks == 4  # a was the oldest; now the most recent
    assert evict_host(tree, 4) == 4
    assert _on_host(tree, b) == [] and _on_host(tree, c) == [0, 1, 2, 3]
    assert evict_host(tree, 4) == 4
    assert _on_host(tree, c) == [] and _on_host(tree, a) == [0, 1, 2, 3]
    check_invariants(tree)


def test_eviction_takes_the_touched_leaf_end_before_its_ancestor() -> None:
    tree = HybridRadixTree(8, 8)
    hs = _conv(b"x", 8)
    _store(tree, hs, (4, 8))  # two nodes: [0, 4) and [4, 8)
    tree.match(hs)  # stamps the leaf, then its parent (the parent is more recent)
    assert evict_host(tree, 1) == 1
    assert _on_host(tree, hs) == [0, 1, 2, 3, 4, 5, 6]
    assert evict_host(tree, 3) == 3
    assert _on_host(tree, hs) == [0, 1, 2, 3]
    check_invariants(tree)


def test_locked_path_is_skipped_and_rejoins_as_most_recent_when_unlocked() -> None:
    tree = HybridRadixTree(12, 8)
    a, b, c = _conv(b"a", 4), _conv(b"b", 4), _conv(b"c", 4)
    for hs in (a, b):
        _store(tree, hs, (4,))
    handle = tree.lock(tree.match(a))
    assert handle is not None
    assert evict_host(tree, 8) == 4  # only b: a's host KV is locked
    assert _on_host(tree, a) == [0, 1, 2, 3]
    _store(tree, c, (4,))
    tree.unlock(handle)  # a rejoins the LRU as its most recent member
    check_invariants(tree)
    assert evict_host(tree, 4) == 4
    assert _on_host(tree, c) == [] and _on_host(tree, a) == [0, 1, 2, 3]
    check_invariants(tree)


def test_lru_heaps_stay_bounded_under_hits_and_churn() -> None:
    rng = random.Random(7)
    tree = HybridRadixTree(64, 32)
    convs: list[list[bytes]] = []
    for n in range(1500):
        hs = _conv(b"%d" % n, 4)
        convs.append(hs)
        _store(tree, hs, (2, 4))  # evicts older conversations once the pool is full
        for q in rng.sample(convs, min(5, len(convs))):
            tree.match(q)
        evict_host_mamba(tree, rng.randint(0, 1))
        entries = sum(1 for _ in tree.policy.lru_entries())
        assert entries <= 4 * max(tree.num_nodes, 1) + 2 * 1024 + 2, (n, entries)
        if n % 100 == 0:
            check_invariants(tree)
    check_invariants(tree)


def test_nodes_that_leave_the_tree_do_not_pile_up_in_the_heaps() -> None:
    """Host-only conversations: eviction empties and detaches their nodes, whose entries
    are dropped as eviction reaches them or in bulk, and the LRUs stay exact meanwhile."""
    rng = random.Random(11)
    tree = HybridRadixTree(48, 24)
    convs: list[list[bytes]] = []
    for n in range(4000):
        hs = _conv(b"h%d" % n, 4)
        convs.append(hs)
        _store(tree, hs, (2, 4), from_device=False)
        for q in rng.sample(convs[-50:], min(3, len(convs))):
            tree.match(q)
        entries = sum(1 for _ in tree.policy.lru_entries())
        assert entries <= 4 * max(tree.num_nodes, 1) + 2 * 1024 + 2, (n, entries)
        if n % 250 == 0:
            check_invariants(tree)
    check_invariants(tree)
