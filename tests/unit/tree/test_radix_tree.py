"""Unit tests for the hybrid radix tree: one behaviour each, invariants checked throughout."""

from __future__ import annotations

import pytest

from himamba.connector.tree import GPU, NO_SLOT, HybridRadixTree, check_invariants
from tests.unit.tree.tree_helpers import (
    chain,
    evict_device,
    evict_host,
    evict_host_mamba,
    hit_count,
    store,
)


def test_match_returns_deepest_boundary_with_both_kv_and_state() -> None:
    tree = HybridRadixTree(32, 8)
    h = chain("abcdef")
    store(tree, h, states=(2, 4))
    res = tree.match(h)
    assert res.num_blocks == 4 and res.host_num_blocks == 4
    assert len(res.kv_slots) == 4 and NO_SLOT not in res.kv_slots
    assert res.mamba_slot != NO_SLOT and not res.storage_blocks
    assert tree.match(h, max_blocks=3).num_blocks == 2
    assert tree.match(chain("abx")).num_blocks == 2  # diverges inside: best below the split
    check_invariants(tree)


def test_different_partition_never_matches_even_with_equal_hashes() -> None:
    tree = HybridRadixTree(16, 4)
    h = chain("abc")
    store(tree, h, part="salt-1", states=(3,))
    assert tree.match(h, "salt-2").num_blocks == 0
    assert tree.match(h).num_blocks == 0
    assert tree.match(h, "salt-1").num_blocks == 3


def test_branching_requests_split_once_and_share_the_prefix() -> None:
    tree = HybridRadixTree(16, 4)
    store(tree, chain("sysab"), states=(5,))
    store(tree, chain("syscd"), states=(3, 5))
    assert tree.stats()["host_kv_used"] == 7  # "sys" stored once
    assert tree.match(chain("sysab")).num_blocks == 5
    assert tree.match(chain("syscd")).num_blocks == 5
    assert tree.match(chain("sysz")).num_blocks == 3
    check_invariants(tree)


def test_gpu_prefix_blocks_are_skipped_and_only_the_rest_is_loaded() -> None:
    tree = HybridRadixTree(16, 4)
    h = chain("abcdef")
    store(tree, h, states=(6,))
    res = tree.match(h, start_block=4)
    assert res.num_blocks == 6 and res.start_block == 4 and len(res.kv_slots) == 2
    assert tree.match(h, start_block=6).num_blocks == 0  # nothing beyond vLLM's own hit


def test_storage_only_blocks_and_state_form_the_prefetch_plan() -> None:
    tree = HybridRadixTree(16, 4)
    h = chain("abcd")
    store(tree, h[:2], states=(2,))
    tree.mark_storage(h, None, 4, state_ends=[4])
    res = tree.match(h)
    assert res.num_blocks == 4 and res.storage_blocks == [2, 3] and res.mamba_in_storage
    assert res.kv_slots[2:] == [NO_SLOT, NO_SLOT] and res.host_num_blocks == 2
    check_invariants(tree)


def test_state_slot_names_the_host_state_of_the_full_or_host_only_hit() -> None:
    tree = HybridRadixTree(16, 4)
    h = chain("abcd")
    store(tree, h[:2], states=(2,))
    tree.mark_storage(h, None, 4, state_ends=[4])
    res = tree.match(h)
    assert res.state_slot() == NO_SLOT  # the full hit's state is storage-only
    assert res.state_slot(host_only=True) == tree.match(h[:2]).mamba_slot != NO_SLOT
    with pytest.raises(ValueError):
        tree.match(chain("zz")).state_slot()


def test_locked_hit_survives_eviction_pressure_and_is_freed_after_unlock() -> None:
    tree = HybridRadixTree(4, 1)
    h = chain("abcd")
    store(tree, h, states=(4,))
    evict_device(tree, h, None)  # host is now the only tier
    res = tree.match(h)
    handle = tree.lock(res)
    assert handle is not None
    assert evict_host(tree, 4) == 0 and evict_host_mamba(tree, 1) == 0
    assert tree.reserve_kv(chain("zz"), None, 0) is None  # degrade, never crash
    assert tree.reserve_mamba(chain("zz"), None, 1) is None
    assert tree.stats()["alloc_failures"] == 2
    check_invariants(tree)
    tree.unlock(handle)
    assert evict_host(tree, 4) == 4
    # the KV of the whole prefix is gone from every tier: the state below it goes with it
    assert tree.stats()["host_mamba_used"] == 0 and tree.stats()["nodes"] == 0
    check_invariants(tree)


def test_state_whose_prefix_died_while_locked_is_dropped_at_unlock() -> None:
    tree = HybridRadixTree(8, 2)
    h = chain("abcd")
    store(tree, h, states=(2, 4))
    res = tree.match(h, start_block=2)
    handle = tree.lock(res)
    evict_device(tree, h, None, 0, 2)  # blocks 0,1 keep their host copy: still alive
    evict_host(tree, 8)  # "ab" is not locked by a load starting at 2? it is: path lock
    check_invariants(tree)
    assert tree.match(h, start_block=2).num_blocks == 4
    tree.unlock(handle)
    check_invariants(tree)


def test_cascade_drops_unlocked_states_below_but_keeps_locked_ones() -> None:
    tree = HybridRadixTree(16, 4)
    a, b = chain("pab"), chain("pcd")
    store(tree, a, states=(3,))
    store(tree, b, states=(3,))
    evict_device(tree, a, None)
    evict_device(tree, b, None)
    handle = tree.lock(tree.match(b))
    tree.evict_storage(a, None)  # no-op tier, nothing changes
    evict_host(tree, 16)
    assert tree.match(a).num_blocks == 0  # "pab" evicted, its state cascaded
    assert tree.stats()["host_mamba_used"] == 1  # only the locked one remains
    check_invariants(tree)
    tree.unlock(handle)
    check_invariants(tree)


def test_evicting_host_mamba_leaves_a_tombstone_and_keeps_kv() -> None:
    tree = HybridRadixTree(8, 2)
    h = chain("abcd")
    store(tree, h, states=(2, 4))
    tree.match(h)  # consumes the state at 4: it becomes MRU, the one at 2 stays LRU
    assert evict_host_mamba(tree, 1) == 1
    assert tree.match(h, max_blocks=2).num_blocks == 0  # state at 2 evicted first
    assert tree.match(h).num_blocks == 4
    assert tree.stats()["host_kv_used"] == 4
    check_invariants(tree)


def test_match_refreshes_only_the_consumed_mamba_state() -> None:
    tree = HybridRadixTree(16, 3)
    h = chain("abcdef")
    store(tree, h, states=(2, 4, 6))
    tree.match(h, max_blocks=4)  # consumes 4 only; 2 is not refreshed (#31643)
    evict_host_mamba(tree, 1)
    assert tree.match(h, max_blocks=2).num_blocks == 0
    assert tree.match(h, max_blocks=4).num_blocks == 4


def test_rolled_back_store_frees_its_slot_and_is_not_matchable() -> None:
    tree = HybridRadixTree(4, 2)
    h = chain("ab")
    slot = tree.reserve_kv(h, None, 0)
    assert slot is not None and tree.reserve_kv(h, None, 0) is None  # in flight
    assert tree.match(h).num_blocks == 0
    tree.complete_store([slot], ok=False)
    assert tree.stats()["host_kv_used"] == 0
    check_invariants(tree)


def test_store_of_a_block_whose_prefix_is_gpu_only_marks_the_prefix_gpu() -> None:
    tree = HybridRadixTree(4, 2)
    h = chain("abc")
    slot = tree.reserve_kv(h, None, 2)
    tree.complete_store([slot])
    node = tree.forest.locate(h, None, 3)[0]
    assert list(node.flags[:2]) == [GPU, GPU]
    evict_device(tree, h, None, 0, 1)  # block 0 lost everywhere: block 2's host copy is dead
    assert tree.stats()["host_kv_used"] == 0 and tree.stats()["nodes"] == 0
    check_invariants(tree)


def test_lock_handle_releases_what_it_locked_even_if_a_state_arrives_later() -> None:
    tree = HybridRadixTree(8, 2)
    h = chain("abc")
    store(tree, h)
    tree.mark_storage(h, None, 3, state_ends=[3])  # state only in storage: nothing to lock on host
    handle = tree.lock(tree.match(h))
    assert handle is not None and handle.mamba_node is None
    slot = tree.reserve_mamba(h, None, 3, from_device=False)  # prefetch lands meanwhile
    tree.complete_store(mamba_slots=[slot])
    tree.unlock(handle)  # must not decrement a mamba lock it never took (#27147)
    check_invariants(tree)
    with pytest.raises(RuntimeError):
        tree.unlock(handle)


def test_reset_drops_everything_but_keeps_inflight_work_until_released() -> None:
    tree = HybridRadixTree(8, 2)
    h = chain("abcd")
    store(tree, h, states=(4,))
    handle = tree.lock(tree.match(h))
    pending = tree.reserve_kv(chain("xy"), None, 1)
    tree.reset()
    check_invariants(tree)
    assert tree.stats()["host_kv_used"] == 5  # 4 locked + 1 in flight
    tree.unlock(handle)
    tree.complete_store([pending])
    check_invariants(tree)
    assert tree.stats()["host_kv_used"] == 0 and tree.stats()["nodes"] == 0


def test_split_of_a_locked_node_keeps_the_lock_on_both_halves() -> None:
    tree = HybridRadixTree(8, 4)
    h = chain("abcd")
    store(tree, h, states=(4,))
    handle = tree.lock(tree.match(h))
    store(tree, chain("abzz"), states=(2,))  # splits the locked node after "ab"
    evict_device(tree, h, None)
    assert evict_host(tree, 8) >= 2  # only the unlocked "zz" branch may go
    assert tree.match(h).num_blocks == 4
    tree.unlock(handle)
    check_invariants(tree)


def test_hit_counts_grow_with_loads_not_lookups_for_selective_write_through() -> None:
    tree = HybridRadixTree(8, 2)
    h = chain("abc")
    store(tree, h, states=(3,))
    for _ in range(3):
        tree.match(h)  # a lookup alone is no use of the prefix
    assert hit_count(tree, h, None, 1) == 0
    for _ in range(3):
        tree.unlock(tree.lock(tree.match(h)))
    assert hit_count(tree, h, None, 1) == 3
    assert hit_count(tree, chain("q"), None, 0) == 0
