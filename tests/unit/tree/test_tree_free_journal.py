"""The worker hears of every host slot the tree gives up: with ``journal_frees`` on, each slot
freed or quarantined, by any path of the tree, is journaled once, and ``take_freed`` drains it."""

from __future__ import annotations

from himamba.connector.tree import HybridRadixTree, check_invariants
from tests.unit.tree.tree_helpers import chain, evict_device, evict_host, evict_host_mamba, store


def _journaled_tree(kv: int = 8, mamba: int = 4) -> HybridRadixTree:
    tree = HybridRadixTree(kv, mamba)
    tree.journal_frees = True
    return tree


def _kv_slots(tree: HybridRadixTree, hashes: list[bytes]) -> list[int]:
    out = []
    for i in range(len(hashes)):
        found = tree.forest.locate(hashes, None, i + 1)
        assert found is not None
        out.append(found[0].slot(found[1]))
    return out


def test_the_journal_is_off_by_default_and_records_nothing() -> None:
    tree = HybridRadixTree(2, 1)
    assert not tree.journal_frees
    store(tree, chain("ab"), states=(2,))
    tree.reset()
    assert tree.take_freed() == ([], [])
    assert tree.kv_slots.journal is None and tree.mamba_slots.journal is None


def test_turning_the_journal_off_drops_it() -> None:
    tree = _journaled_tree()
    store(tree, chain("ab"))
    tree.reset()
    tree.journal_frees = False
    assert not tree.journal_frees and tree.take_freed() == ([], [])


def test_lru_eviction_of_blocks_and_states_is_journaled() -> None:
    tree = _journaled_tree()
    h = chain("abcd")
    store(tree, h, states=(2, 4))
    kv = _kv_slots(tree, h)
    evict_device(tree, h, None)
    state_at_4 = tree.match(h).mamba_slot
    assert tree.take_freed() == ([], [])
    # Block 3 had only its host copy: the state at 4 dies with it (invariant P).
    assert evict_host(tree, 1) == 1
    assert tree.take_freed() == ([kv[3]], [state_at_4])
    state_at_2 = tree.match(h).mamba_slot
    assert evict_host_mamba(tree, 1) == 1
    assert tree.take_freed() == ([], [state_at_2])
    assert tree.take_freed() == ([], [])  # drained
    check_invariants(tree)


def test_the_cascade_after_a_lost_block_is_journaled() -> None:
    tree = _journaled_tree()
    h = chain("abcd")
    slots = [tree.reserve_kv(h, None, i) for i in (1, 2, 3)]  # block 0 only on GPU
    state = tree.reserve_mamba(h, None, 4)
    tree.complete_store(slots, [state])
    evict_device(tree, h, None, 0, 1)  # block 0 lost everywhere: all after it is dead
    kv, mamba = tree.take_freed()
    assert sorted(kv) == sorted(slots) and mamba == [state]
    assert tree.stats()["host_kv_used"] == 0
    check_invariants(tree)


def test_replaced_states_rollbacks_and_reset_are_journaled() -> None:
    tree = _journaled_tree()
    h = chain("abcd")
    store(tree, h, states=(2, 4))
    kv = _kv_slots(tree, h)
    state_at_2, state_at_4 = tree.match(h, max_blocks=2).mamba_slot, tree.match(h).mamba_slot
    assert tree.drop_state(h, None, 2)
    assert tree.take_freed() == ([], [state_at_2])
    slot = tree.reserve_kv(chain("x"), None, 0)
    mslot = tree.reserve_mamba(chain("x"), None, 1)
    tree.complete_store([slot], [mslot], ok=False)
    assert tree.take_freed() == ([slot], [mslot])
    tree.reset()
    got_kv, got_mamba = tree.take_freed()
    assert sorted(got_kv) == sorted(kv) and got_mamba == [state_at_4]
    check_invariants(tree)


def test_a_quarantined_slot_is_journaled_once_when_quarantined() -> None:
    tree = _journaled_tree(kv=2)
    tree.write_back = lambda is_state, slot, h, part: True
    h = chain("ab")
    store(tree, h)
    evict_device(tree, h, None)
    kv = _kv_slots(tree, h)
    assert evict_host(tree, 1) == 1
    assert tree.take_freed() == ([kv[1]], [])
    tree.seal_plan()  # now allocatable: the worker already heard of it
    assert tree.take_freed() == ([], [])
    check_invariants(tree)
