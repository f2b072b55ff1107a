"""A request storing its blocks step after step never evicts its own earlier blocks to make
room: ``reserve_kv_run`` holds the request's path for the call, so only other paths' host
blocks are victims, and with none left the run stops."""

from __future__ import annotations

from himamba.connector.tree import HybridRadixTree, StoreCursor, check_invariants
from tests.unit.tree.tree_helpers import chain, evict_device, host_blocks, store


def test_a_long_request_keeps_its_stored_blocks_while_older_paths_make_room() -> None:
    tree = HybridRadixTree(8, 2)
    older = chain(4, salt="older")
    store(tree, older)
    evict_device(tree, older, None)  # an older conversation, on host only
    req = chain(16, salt="req")
    stored: list[int] = []
    for step in range(8):  # two blocks per step, committed before the next step
        run = tree.reserve_kv_run(req, None, 2 * step, 2 * step + 2)
        tree.complete_store([s for _, s in run], [])
        stored += [i for i, _ in run]
        check_invariants(tree)
        # Nothing this request stored has left the host tier for its own later blocks.
        assert host_blocks(tree, req, None) == stored, (step, stored)
    # Four free slots, then the older conversation's four blocks: eight in all, in order.
    assert stored == list(range(8))
    assert host_blocks(tree, older, None) == []
    assert tree.stats()["kv_evicted"] == 4


def test_a_run_shared_by_two_requests_evicts_the_other_branch_not_the_common_prefix() -> None:
    tree = HybridRadixTree(6, 2)
    trunk = chain("sys")
    branch_a, branch_b = trunk + chain("ab", salt="a"), trunk + chain("cd", salt="b")
    run = tree.reserve_kv_run(branch_a, None, 0, 5)
    tree.complete_store([s for _, s in run], [])
    evict_device(tree, branch_a, None, 3, 5)  # a's own tail: host only now, a's request is gone
    run = tree.reserve_kv_run(branch_b, None, 3, 5)
    tree.complete_store([s for _, s in run], [])
    # b needed two slots and had one free: a's tail went (not b's shared prefix "sys").
    assert [i for i, _ in run] == [3, 4]
    assert host_blocks(tree, branch_b, None) == [0, 1, 2, 3, 4]
    assert host_blocks(tree, branch_a, None) == [0, 1, 2, 3]
    check_invariants(tree)


def test_runs_with_gaps_and_interleaved_commits_keep_flags_and_counters_exact() -> None:
    """A run over blocks some of which are already on the host reserves only the others
    (a span split in pieces); commits and rollbacks arrive out of order and interleaved
    between nodes. The counters kept beside the flags must stay exact throughout."""
    tree = HybridRadixTree(64, 4)
    req = chain(12, salt="gaps")
    first = tree.reserve_kv_run(req, None, 0, 12)
    mine = [s for i, s in first if i in (2, 3, 7)]
    tree.complete_store(mine, [])  # blocks 2, 3, 7 on host; the rest rolled back below
    rest = [s for i, s in first if i not in (2, 3, 7)]
    tree.complete_store(rest[::-1], [], ok=False)
    check_invariants(tree)
    assert host_blocks(tree, req, None) == [2, 3, 7]
    run = tree.reserve_kv_run(req, None, 0, 12)
    assert [i for i, _ in run] == [0, 1, 4, 5, 6, 8, 9, 10, 11]
    check_invariants(tree)
    slots = [s for _, s in run]
    tree.complete_store(slots[::2], [], ok=True)  # every other one, then the rest failed
    check_invariants(tree)
    tree.complete_store(slots[1::2], [], ok=False)
    check_invariants(tree)
    assert host_blocks(tree, req, None) == [0, 2, 3, 4, 6, 7, 9, 11]
    assert tree.stats()["pending_stores"] == 0


def _runs_of_a_plan(tree: HybridRadixTree, req: list[bytes]) -> list[int]:
    """Two new-leaf runs of one request, reserved as a step plan reserves them."""
    cursor = StoreCursor()
    slots = [s for _, s in tree.reserve_kv_run(req, None, 0, 6, True, cursor)]
    slots += [s for _, s in tree.reserve_kv_run(req, None, 6, 10, True, cursor)]
    return slots


def test_a_plan_committing_its_runs_after_a_split_of_their_node_commits_every_block() -> None:
    """A run's blocks wait unlisted until the plan commits them; a state reserved inside
    the run (a cut of its node) between the two must not leave a block pending or commit
    the wrong one."""
    tree = HybridRadixTree(64, 8)
    req = chain(10, salt="split")
    slots = _runs_of_a_plan(tree, req)
    state = tree.reserve_mamba(req, None, 3)  # cuts the first run's node after block 2
    assert state is not None
    check_invariants(tree)
    tree.complete_store(slots, [state])
    check_invariants(tree)
    assert host_blocks(tree, req, None) == list(range(10))
    assert tree.stats()["pending_stores"] == 0
    assert tree.stats()["stores_committed"] == 11


def test_single_slots_planned_before_the_runs_and_a_look_at_the_map_commit_exactly() -> None:
    """A plan whose list starts with a block reserved alone (a tail), then the runs; and a
    plan whose pending map is read between reserve and commit (stats): both commit exactly
    the slots they list, counters and flags exact, nothing stale."""
    for look in (False, True):
        tree = HybridRadixTree(64, 8)
        other = chain(3, salt=f"tail-{look}")
        lone = tree.reserve_kv(other, None, 0)
        assert lone is not None
        req = chain(10, salt=f"req-{look}")
        slots = _runs_of_a_plan(tree, req)
        if look:
            assert tree.stats()["pending_stores"] == 11
        tree.complete_store([lone, *slots], [])
        check_invariants(tree)
        assert host_blocks(tree, req, None) == list(range(10))
        assert host_blocks(tree, other, None) == [0]
        stats = tree.stats()
        assert (stats["pending_stores"], stats["stale_completions"]) == (0, 0)
        assert stats["stores_committed"] == 11


def test_a_plan_rolling_back_part_of_its_runs_frees_exactly_those_slots() -> None:
    """Blocks with nothing to copy are rolled back before the plan commits the rest (the
    planner's missing-device-block path): the rollback sees every waiting run."""
    tree = HybridRadixTree(64, 8)
    req = chain(10, salt="rollback")
    slots = _runs_of_a_plan(tree, req)
    free_before = tree.stats()["host_kv_free"]
    tree.complete_store(slots[7:], [], ok=False)
    tree.complete_store(slots[:7], [])
    check_invariants(tree)
    assert host_blocks(tree, req, None) == list(range(7))
    assert tree.stats()["host_kv_free"] == free_before + 3
    assert tree.stats()["pending_stores"] == 0


def test_a_commit_listing_only_part_of_the_waiting_runs_commits_exactly_what_it_lists() -> None:
    """A commit whose list is as long as the waiting runs but not exactly them (a single
    slot in place of a run's last block) must commit the single slot and leave that block
    in flight, not commit the runs wholesale."""
    tree = HybridRadixTree(64, 8)
    other = chain(3, salt="lone")
    lone = tree.reserve_kv(other, None, 0)
    assert lone is not None
    req = chain(10, salt="part")
    slots = _runs_of_a_plan(tree, req)
    tree.complete_store([lone, *slots[:-1]], [])
    check_invariants(tree)
    assert host_blocks(tree, other, None) == [0]
    assert host_blocks(tree, req, None) == list(range(9))
    assert tree.stats()["pending_stores"] == 1
    tree.complete_store(slots[-1:], [])
    check_invariants(tree)
    assert host_blocks(tree, req, None) == list(range(10))
    assert tree.stats()["pending_stores"] == 0
