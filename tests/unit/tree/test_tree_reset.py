"""A reset (new weights) while loads or stores are in flight: the held pre-reset path is set
aside, and the same prefix computed after the reset is stored, hit and kept beside it.

Found by a random-seed run of the property machine: a run committed after a reset onto the
path a pending store held across it landed in that condemned path and was dropped the moment
it was committed (a lost store, never a wrong hit), and a host block locked across the reset
kept a new store of the same prefix out altogether."""

from __future__ import annotations

from himamba.connector.tree import HOST, HybridRadixTree, StoreCursor, check_invariants
from himamba.connector.tree.forest import is_retired
from tests.unit.tree.tree_helpers import chain, store


class StrictObserver:
    """The router's view of the CPU tier: a set per kind; every arrival must be new and
    every departure known, so a hash announced twice or removed under a live copy fails."""

    def __init__(self) -> None:
        self.kv: set[bytes] = set()
        self.states: set[bytes] = set()

    def _note(self, held: set[bytes], entered: bool, h: bytes) -> None:
        if entered:
            assert h not in held, ("announced twice", h)
            held.add(h)
        else:
            assert h in held, ("removed but never announced", h)
            held.discard(h)

    def host_kv(self, entered: bool, block_hash: bytes) -> None:
        self._note(self.kv, entered, block_hash)

    def host_state(self, entered: bool, block_hash: bytes) -> None:
        self._note(self.states, entered, block_hash)


def host_view(tree: HybridRadixTree) -> tuple[set[bytes], set[bytes]]:
    """The hashes a lookup can reach on host (set-aside subtrees excluded)."""
    kv, states = set(), set()
    for x in tree.forest.iter_nodes():
        if is_retired(x):
            continue
        kv.update(h for h, f in zip(x.hashes, x.flags, strict=True) if f & HOST)
        if x.mamba & HOST:
            states.add(x.hashes[-1])
    return kv, states


def test_a_prefix_stored_after_a_reset_hits_while_the_old_path_is_still_locked() -> None:
    tree = HybridRadixTree(12, 4)
    h = chain("abcd")
    store(tree, h, states=(4,))
    handle = tree.lock(tree.match(h))  # a load in flight across the reset
    old_slots = set(tree.match(h).kv_slots)
    tree.reset()
    check_invariants(tree)
    assert tree.match(h).num_blocks == 0  # nothing from before the reset is served
    store(tree, h, states=(4,))  # the same prompt, computed with the new weights
    res = tree.match(h)
    assert res.num_blocks == 4 and res.host_num_blocks == 4
    assert not set(res.kv_slots) & old_slots  # new bytes in new slots
    assert tree.stats()["host_kv_used"] == 8  # both copies until the load is done
    tree.unlock(handle)
    check_invariants(tree)
    res = tree.match(h)
    assert res.num_blocks == 4 and res.host_num_blocks == 4
    assert tree.stats()["host_kv_used"] == 4 and tree.stats()["host_mamba_used"] == 1


def test_a_store_in_flight_across_a_reset_does_not_take_a_new_run_with_it() -> None:
    tree = HybridRadixTree(12, 4)
    old = chain("abcd")
    pending = tree.reserve_kv_run(old, None, 3, 4)  # a pre-reset copy not yet committed
    tree.reset()
    h = chain("abcde")  # a new request through the same blocks, stored in two runs
    cursor = StoreCursor()
    kv = [s for _, s in tree.reserve_kv_run(h, None, 0, 2, True, cursor)]
    states = [tree.reserve_mamba(h, None, 2, cursor=cursor)]
    kv += [s for _, s in tree.reserve_kv_run(h, None, 2, 5, True, cursor)]
    states.append(tree.reserve_mamba(h, None, 5, cursor=cursor))
    assert len(kv) == 5 and None not in states
    tree.complete_store(kv, states, ok=True)
    check_invariants(tree)
    assert tree.match(h).num_blocks == 5
    tree.complete_store([s for _, s in pending], [], ok=True)  # the old copy lands, late
    check_invariants(tree)
    res = tree.match(h)
    assert res.num_blocks == 5 and sorted(res.kv_slots) == sorted(kv)
    assert tree.stats()["host_kv_used"] == 5 and tree.stats()["nodes"] >= 1


def test_the_observer_hears_the_set_aside_blocks_leave_once_and_nothing_of_them_after() -> None:
    tree = HybridRadixTree(16, 6)
    seen = StrictObserver()
    tree.set_observer(seen)
    h = chain("abcd")
    store(tree, h, states=(2, 4))
    handle = tree.lock(tree.match(h))
    pending = tree.reserve_kv(chain("abcdx"), None, 4)  # a store under the locked path
    tree.reset()
    assert (seen.kv, seen.states) == host_view(tree) == (set(), set())
    store(tree, h, states=(2, 4))  # the same hashes again, on a fresh path
    assert (seen.kv, seen.states) == host_view(tree) and len(seen.kv) == 4
    tree.complete_store([pending], ok=True)  # the set-aside store commits: silent
    tree.unlock(handle)  # the set-aside path goes: silent too
    check_invariants(tree)
    assert (seen.kv, seen.states) == host_view(tree) and len(seen.states) == 2
    tree.reset()
    assert (seen.kv, seen.states) == (set(), set())
    assert tree.stats()["host_kv_used"] == 0 and tree.stats()["nodes"] == 0


def test_a_second_reset_while_the_first_ones_path_is_held_keeps_both_apart() -> None:
    tree = HybridRadixTree(16, 6)
    h = chain("abc")
    store(tree, h, states=(3,))
    first = tree.lock(tree.match(h))
    tree.reset()
    store(tree, h, states=(3,))
    second = tree.lock(tree.match(h))
    tree.reset()
    check_invariants(tree)
    assert tree.match(h).num_blocks == 0
    assert tree.stats()["host_kv_used"] == 6  # two held generations, neither served
    store(tree, h, states=(3,))
    assert tree.match(h).num_blocks == 3
    tree.unlock(second)
    tree.unlock(first)
    check_invariants(tree)
    assert tree.match(h).num_blocks == 3
    assert tree.stats()["host_kv_used"] == 3 and tree.stats()["host_mamba_used"] == 1
