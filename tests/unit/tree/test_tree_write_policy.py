"""Tree support for conversations and storage write policies: junction depth, replacing a
request's older decode state, hot objects for selective write-through, write-back on eviction."""

from __future__ import annotations

from himamba.connector.tree import HybridRadixTree, check_invariants
from himamba.mamba_state.state_budget import StateBudget
from himamba.tiers.object_format import ObjectKind
from tests.unit.tree.tree_helpers import chain, store


def test_depth_is_where_a_request_leaves_every_known_path() -> None:
    tree = HybridRadixTree(16, 4)
    shared = chain("sysprompt")
    store(tree, shared + chain("abc", salt="conv1"), states=(12,))
    other = shared + chain("xyz", salt="conv2")
    assert tree.depth(other, None) == len(shared)
    assert tree.depth(chain("nothing"), None) == 0


def test_a_newer_decode_state_replaces_the_older_one_unless_a_load_holds_it() -> None:
    tree = HybridRadixTree(16, 4)
    h = chain("abcdefgh")
    store(tree, h, states=(4, 6))
    used = tree.mamba_slots.num_used
    assert tree.drop_state(h, None, 4)
    assert tree.mamba_slots.num_used == used - 1
    assert tree.match(h, max_blocks=5).num_blocks == 0  # no state at 4 any more
    assert tree.match(h).num_blocks == 6  # the newer one still serves
    handle = tree.lock(tree.match(h))
    assert not tree.drop_state(h, None, 6)  # a load reads it: it stays
    tree.unlock(handle)
    assert tree.drop_state(h, None, 6)
    check_invariants(tree)


def test_hot_objects_are_the_host_hit_walked_often_enough_and_only_once() -> None:
    tree = HybridRadixTree(16, 4)
    h = chain("abcd")
    store(tree, h, states=(4,))
    for _ in range(3):
        tree.match(h)  # lookups are no use of the prefix
    first = tree.match(h)
    handle = tree.lock(first, host_only=True)  # its first load: below a threshold of 2
    assert tree.hot_objects(first, 2) == []
    tree.unlock(handle)
    second = tree.match(h)
    handle = tree.lock(second, host_only=True)
    hot = tree.hot_objects(second, 2)
    assert sorted(o.kind for o in hot) == [ObjectKind.KV] * 4 + [ObjectKind.MAMBA]
    tree.unlock(handle)
    third = tree.match(h)
    handle = tree.lock(third, host_only=True)
    assert tree.hot_objects(third, 2) == []  # already marked as in storage
    tree.unlock(handle)
    check_invariants(tree)


def test_write_back_keeps_an_evicted_block_as_a_storage_entry() -> None:
    tree = HybridRadixTree(4, 4)
    written: list[tuple[bool, int, bytes]] = []
    tree.write_back = lambda is_state, slot, h, part: written.append((is_state, slot, h)) or True
    a = chain("abcd", salt="a")
    store(tree, a, states=(4,))
    store(tree, chain("efgh", salt="b"), states=(4,))  # evicts a's blocks one by one
    assert len([w for w in written if not w[0]]) == 4
    res = tree.match(a)
    # Nothing of `a` is on host any more, but all of it is loadable from storage.
    assert res.num_blocks == 4 and res.host_num_blocks == 0
    assert res.storage_blocks == [0, 1, 2, 3]
    check_invariants(tree)


def test_state_budget_keeps_prompt_end_junction_checkpoints_and_latest_decode_state() -> None:
    budget = StateBudget(block_size=128, interval_tokens=1000)  # rounds up to 1024
    book = budget.open(num_prompt_tokens=1000, known_blocks=2)
    assert (book.prompt_end, book.junction, budget.interval) == (896, 256, 1024)
    # Prefill: only the junction and the prompt end (512 is no checkpoint).
    assert [budget.decide(book, b) for b in (256, 512, 896)] == [(True, 0), (False, 0), (True, 0)]
    # Decode: each new boundary replaces the previous one, except checkpoints, which stay.
    expected = {1024: (True, 0), 1152: (True, 0), 1280: (True, 1152), 1408: (True, 1280)}
    for boundary, decision in expected.items():  # 1024 is a checkpoint: not replaced
        assert budget.decide(book, boundary) == decision
        budget.stored(book, boundary)


def test_state_budget_book_moves_only_when_a_state_was_stored() -> None:
    budget = StateBudget(block_size=128, interval_tokens=4096)
    book = budget.open(num_prompt_tokens=300, known_blocks=0)  # prompt end 256
    assert budget.decide(book, 384) == (True, 0)
    budget.stored(book, 384)
    # No slot for 512: nothing stored, so 640 must still replace 384 (not orphan it).
    assert budget.decide(book, 512) == (True, 384)
    assert budget.decide(book, 640) == (True, 384)
    budget.stored(book, 640)
    # A replay after preemption crosses 384 and 512 again: nothing to store or replace.
    assert budget.decide(book, 384) == (False, 0)
    assert budget.decide(book, 512) == (False, 0)
    assert book.last_decode == 640
