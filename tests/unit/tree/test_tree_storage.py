"""The tree's side of the storage tier: applying a probe answer in one walk, the boundaries a
prefetch planner chooses from, and pins that keep the host prefix of a prefetch in place."""

from __future__ import annotations

import gc
import time

import pytest

from himamba.connector.tree import NO_SLOT, HybridRadixTree, check_invariants
from tests.unit.tree.tree_helpers import chain, evict_device, evict_host, evict_host_mamba, store


# ---------------------------------------------------------------- probe answers
def _build(existing: str, n: int) -> tuple[HybridRadixTree, list]:
    h = chain(n)
    tree = HybridRadixTree(n, 8)
    if existing == "one_gpu_node":
        tree.mark_device(h, None, n)
    elif existing == "host_write_through":
        store(tree, h)
        evict_device(tree, h, None)
        slot = tree.reserve_kv(h, None, n - 1, from_device=False)  # already on host: None
        assert slot is None
    return tree, h


def _mark_every_state_seconds(existing: str, n: int) -> float:
    """Best of three, with the garbage collector paused: in a long pytest session a full
    collection walks every object the earlier tests left (it made one run take 0.6 s on CI),
    and the fastest run is the one least disturbed by other load on the machine."""
    best = float("inf")
    for _ in range(3):
        tree, h = _build(existing, n)
        gc.disable()
        try:
            t0 = time.perf_counter()
            tree.mark_storage(h, None, n, state_ends=range(1, n + 1))
            best = min(best, time.perf_counter() - t0)
        finally:
            gc.enable()
    return best


@pytest.mark.parametrize("existing", ["none", "one_gpu_node", "host_write_through"])
def test_probe_answer_with_a_state_at_every_block_is_one_linear_walk(existing: str) -> None:
    """4,000 blocks with a state at each: one walk, even when it must cut a 4,000-block node
    into 4,000 pieces (the old per-state walks took 1.4 s at 1,000 blocks and grew with the
    square). Timed as a ratio to 500 blocks, so a loaded CI machine cannot fail it: 8x the
    blocks must cost well under the 64x of a quadratic walk."""
    n = 4000
    small, large = (
        _mark_every_state_seconds(existing, n // 8),
        _mark_every_state_seconds(existing, n),
    )
    assert large < 24 * small, f"mark_storage: {small:.4f} s at {n // 8}, {large:.4f} s at {n}"
    tree, h = _build(existing, n)
    tree.mark_storage(h, None, n, state_ends=range(1, n + 1))
    res = tree.match(h)
    assert res.num_blocks == n and res.mamba_in_storage
    assert res.boundaries == [(b, False) for b in range(1, n + 1)]  # every state is seen
    if existing == "host_write_through":
        assert res.host_num_blocks == 0 and not res.storage_blocks  # KV on host, states not
    else:
        assert res.storage_blocks == list(range(n))
    assert tree.num_nodes == n
    check_invariants(tree)


def test_probe_answer_marks_only_the_states_it_names() -> None:
    tree = HybridRadixTree(8, 8)
    h = chain("abcdefgh")
    tree.mark_storage(h, None, 6, state_ends=[6, 2, 2])  # any order, duplicates allowed
    assert tree.match(h).boundaries == [(2, False), (6, False)]
    assert tree.match(h, max_blocks=5).num_blocks == 2
    tree.mark_storage(h, None, 8)  # KV only: no state at 8, so no deeper hit
    assert tree.match(h).num_blocks == 6
    with pytest.raises(ValueError):
        tree.mark_storage(h, None, 4, state_ends=[5])
    with pytest.raises(ValueError):
        tree.mark_storage(h, None, 4, state_ends=[0])
    check_invariants(tree)


def test_probe_answer_cutting_several_host_nodes_keeps_all_pieces_evictable() -> None:
    tree = HybridRadixTree(8, 8)
    h = chain("abcdef")
    store(tree, h, states=(3, 6))
    evict_device(tree, h, None)
    tree.mark_storage(h, None, 6, state_ends=[1, 4])  # cuts inside both host nodes
    check_invariants(tree)  # every new piece holds host KV: each is in the host LRU
    assert tree.match(h).boundaries == [(1, False), (3, True), (4, False), (6, True)]
    assert evict_host(tree, 6) == 6
    res = tree.match(h)  # storage still holds every block: the states stay reachable
    assert res.num_blocks == 6 and res.host_num_blocks == 0
    assert res.storage_blocks == list(range(6)) and res.mamba_slot != NO_SLOT
    check_invariants(tree)


# ---------------------------------------------------------------- boundaries of a match
def test_match_lists_every_loadable_boundary_with_its_tier() -> None:
    tree = HybridRadixTree(16, 8)
    h = chain("abcdefgh")
    store(tree, h[:2], states=(2,))
    tree.mark_storage(h, None, 6, state_ends=[4, 6])
    assert tree.match(h).boundaries == [(2, True), (4, False), (6, False)]
    assert tree.match(h, start_block=2).boundaries == [(4, False), (6, False)]
    assert tree.match(h, max_blocks=5).boundaries == [(2, True), (4, False)]
    assert tree.match(chain("zz")).boundaries == []


# ---------------------------------------------------------------- pins
def _prefetch_setup() -> tuple[HybridRadixTree, list[bytes]]:
    """A 16-block conversation: blocks 0..5 on host only (pool of 8), all 16 in storage."""
    tree = HybridRadixTree(8, 8)
    h = chain("abcdefghijklmnop")
    store(tree, h[:6], states=(3, 6))
    evict_device(tree, h, None)  # the host copy is all this node has besides storage
    tree.mark_storage(h, None, 16, state_ends=[3, 6, 10, 16])
    return tree, h


def _reserve_plan(tree: HybridRadixTree, h: list[bytes], blocks: list[int]) -> list[int]:
    slots = []
    for i in blocks:
        slot = tree.reserve_kv(h, None, i, from_device=False)
        if slot is None:
            break
        slots.append(slot)
    return slots


def test_pinned_host_prefix_survives_reserving_a_prefetch_longer_than_the_pool() -> None:
    tree, h = _prefetch_setup()
    res = tree.match(h)
    assert res.num_blocks == 16 and res.host_num_blocks == 6
    assert res.storage_blocks == list(range(6, 16))
    pin = tree.pin(h, None, res.num_blocks)
    assert pin.pinned and tree.stats()["pins"] == 1
    reserved = _reserve_plan(tree, h, res.storage_blocks)
    assert len(reserved) == 2  # the two free slots, then the pool is exhausted
    assert tree.stats()["kv_evicted"] == 0 and tree.stats()["alloc_failures"] == 1
    check_invariants(tree)
    again = tree.match(h, max_blocks=6)  # the pinned host prefix is untouched
    assert again.host_num_blocks == 6 and again.kv_slots == res.kv_slots[:6]
    # The planner cannot reach 10 (needs blocks 6..9): it rolls back and keeps the host hit.
    tree.complete_store(reserved, ok=False)
    tree.unlock(pin)
    assert tree.match(h).host_num_blocks == 6
    check_invariants(tree)


def test_without_a_pin_reserving_a_prefetch_evicts_the_prefix_it_extends() -> None:
    """Why pins exist: the host blocks of the prefix were the only evictable ones."""
    tree, h = _prefetch_setup()
    res = tree.match(h)
    reserved = _reserve_plan(tree, h, res.storage_blocks)
    assert len(reserved) > 2 and tree.stats()["kv_evicted"] > 0
    assert tree.match(h, max_blocks=6).host_num_blocks < 6
    tree.complete_store(reserved, ok=False)
    check_invariants(tree)


def test_pin_covers_the_node_of_the_last_block_and_its_ancestors_only() -> None:
    tree = HybridRadixTree(16, 8)
    trunk, branch = chain("abcdef"), chain("abcxyz")
    store(tree, trunk, states=(3, 6))
    store(tree, branch, states=(6,))
    evict_device(tree, trunk, None)
    evict_device(tree, branch, None)
    pin = tree.pin(trunk, None, 5)  # block 4 lives in the node "def": it and "abc" are pinned
    assert pin.mamba_node is None  # no state ends at 5
    assert evict_host(tree, 16) == 3  # only the unpinned branch "xyz" could go
    assert tree.match(trunk).host_num_blocks == 6
    tree.unlock(pin)
    state_pin = tree.pin(trunk, None, 6)  # a host state right at the boundary is kept too
    assert state_pin.mamba_node is not None
    assert evict_host_mamba(tree, 8) == 1  # the state at 3 only
    assert tree.match(trunk).mamba_slot != NO_SLOT
    tree.unlock(state_pin)
    check_invariants(tree)


def test_pin_of_an_unknown_path_is_refused() -> None:
    tree = HybridRadixTree(4, 4)
    h = chain("abc")
    tree.mark_storage(h, None, 2, state_ends=[2])
    with pytest.raises(KeyError):
        tree.pin(h, None, 3)
    with pytest.raises(IndexError):
        tree.pin(h, None, 0)
    pin = tree.pin(h, None, 2)
    tree.unlock(pin)
    with pytest.raises(RuntimeError):
        tree.unlock(pin)
    check_invariants(tree)
