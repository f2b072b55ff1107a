"""One slot, one role per step plan: a host slot that LRU eviction writes back to storage is
read by the worker during the plan being built, so no store of that plan may be given it.
It is quarantined until ``seal_plan``; slots freed without a write-back are reusable at once."""

from __future__ import annotations

from himamba.connector.tree import HybridRadixTree, check_invariants
from himamba.connector.tree.host_eviction import MAX_VICTIMS_PER_ALLOC
from tests.unit.tree.tree_helpers import chain, evict_device, evict_host, store


def _host_only(tree: HybridRadixTree, hashes: list[bytes]) -> None:
    """Store ``hashes`` and drop its GPU marks: the host copy is its only tier."""
    store(tree, hashes)
    evict_device(tree, hashes, None)


def _slot_of(tree: HybridRadixTree, hashes: list[bytes], i: int) -> int:
    found = tree.forest.locate(hashes, None, i + 1)
    assert found is not None
    return found[0].slot(found[1])


def _conserved(tree: HybridRadixTree) -> None:
    s = tree.stats()
    assert s["host_kv_free"] + s["host_kv_quarantined"] + s["host_kv_used"] == s["host_kv_capacity"]
    assert (
        s["host_mamba_free"] + s["host_mamba_quarantined"] + s["host_mamba_used"]
        == s["host_mamba_capacity"]
    )
    check_invariants(tree)


def test_a_written_back_victim_slot_is_not_handed_out_in_the_same_plan() -> None:
    tree = HybridRadixTree(2, 2)
    older, newer = chain("a", salt="old"), chain("b", salt="new")
    _host_only(tree, older)
    _host_only(tree, newer)
    old_slot, new_slot = _slot_of(tree, older, 0), _slot_of(tree, newer, 0)
    written: list[int] = []

    def write_back(is_state: bool, slot: int, block_hash: bytes, partition: object) -> bool:
        if block_hash != older[0]:
            return False  # only the older block is worth a storage write
        written.append(slot)
        return True

    tree.write_back = write_back
    got = tree.reserve_kv(chain("c", salt="req"), None, 0)
    # The older block went first and was written back: its slot is read by this plan's
    # worker, so the allocation evicted a second victim (freed at once) and took its slot.
    assert written == [old_slot]
    assert got == new_slot != old_slot
    assert tree.kv_slots.is_quarantined(old_slot)
    assert tree.stats()["host_kv_quarantined"] == 1 and tree.stats()["kv_evicted"] == 2
    _conserved(tree)


def test_quarantined_slots_become_allocatable_when_the_plan_is_sealed() -> None:
    tree = HybridRadixTree(4, 4)
    tree.write_back = lambda is_state, slot, h, part: True
    conv = chain("abcd")
    _host_only(tree, conv)
    # Every victim is written back: nothing becomes usable this plan, the store must wait.
    assert tree.reserve_kv(chain("x"), None, 0) is None
    assert tree.stats()["host_kv_quarantined"] == 4 and tree.stats()["alloc_failures"] == 1
    assert tree.depth(conv, None) == 4  # kept as storage entries
    _conserved(tree)
    tree.seal_plan()
    assert tree.stats()["host_kv_quarantined"] == 0 and tree.stats()["host_kv_free"] == 4
    assert tree.reserve_kv(chain("x"), None, 0) is not None
    _conserved(tree)


def test_written_back_states_are_quarantined_too() -> None:
    tree = HybridRadixTree(8, 1)
    tree.write_back = lambda is_state, slot, h, part: is_state
    a, b = chain("ab", salt="a"), chain("cd", salt="b")
    store(tree, a, states=(2,))
    state_slot = tree.match(a).mamba_slot
    assert tree.reserve_mamba(b, None, 2) is None  # the only victim is written back
    assert tree.mamba_slots.is_quarantined(state_slot)
    assert tree.stats()["mamba_written_back"] == 1
    assert tree.match(a).mamba_in_storage  # kept as a storage entry
    _conserved(tree)
    tree.seal_plan()
    assert tree.reserve_mamba(b, None, 2) == state_slot
    _conserved(tree)


def test_an_allocation_evicts_a_bounded_number_of_written_back_victims() -> None:
    n = MAX_VICTIMS_PER_ALLOC + 4
    tree = HybridRadixTree(n, 2)
    tree.write_back = lambda is_state, slot, h, part: True
    conv = chain(n)
    _host_only(tree, conv)
    assert tree.reserve_kv(chain("x"), None, 0) is None
    assert tree.stats()["host_kv_quarantined"] == MAX_VICTIMS_PER_ALLOC
    assert tree.stats()["host_kv_used"] == 4
    _conserved(tree)


def test_slots_freed_without_a_write_back_are_reusable_at_once() -> None:
    tree = HybridRadixTree(1, 1)
    tree.write_back = lambda is_state, slot, h, part: False  # the policy declines
    a = chain("a", salt="a")
    _host_only(tree, a)
    slot = _slot_of(tree, a, 0)
    assert tree.reserve_kv(chain("b", salt="b"), None, 0) == slot
    tree.complete_store([slot], ok=False)  # a rollback frees at once as well
    assert tree.reserve_kv(chain("c", salt="c"), None, 0) == slot
    # A block storage already holds needs no write: freed at once, hook not asked.
    tree.complete_store([slot])
    c = chain("c", salt="c")
    tree.mark_storage(c, None, 1)
    evict_device(tree, c, None)

    def never_asked(is_state: bool, slot: int, block_hash: bytes, partition: object) -> bool:
        raise AssertionError("write-back asked for a block storage holds")

    tree.write_back = never_asked
    assert tree.reserve_kv(chain("d", salt="d"), None, 0) == slot
    assert tree.stats()["host_kv_quarantined"] == 0
    _conserved(tree)


def test_reset_and_cascades_leave_quarantined_slots_until_the_seal() -> None:
    tree = HybridRadixTree(4, 2)
    tree.write_back = lambda is_state, slot, h, part: True
    conv = chain("abcd")
    _host_only(tree, conv)
    assert evict_host(tree, 2) == 2  # written back: quarantined, counted as freed
    tree.reset()  # frees the rest now; the plan's worker may still read the quarantined two
    assert tree.stats()["host_kv_quarantined"] == 2 and tree.stats()["host_kv_free"] == 2
    _conserved(tree)
    tree.seal_plan()
    assert tree.stats()["host_kv_free"] == 4
    _conserved(tree)
