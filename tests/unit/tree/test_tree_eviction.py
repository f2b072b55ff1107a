"""What the tree gives up under pressure: host KV one block at a time from the end of the
least recently used conversation, and metadata-only nodes beyond the node budget."""

from __future__ import annotations

from himamba.connector.tree import NO_SLOT, HybridRadixTree, check_invariants
from tests.unit.tree.tree_helpers import chain, evict_device, evict_host, host_blocks, store


def host_only(tree: HybridRadixTree, *convs: list[bytes]) -> None:
    """vLLM dropped their GPU copies: the host copy is the only tier left."""
    for hashes in convs:
        evict_device(tree, hashes, None)


# ---------------------------------------------------------------- per-block host eviction
def test_reserving_one_slot_in_a_full_pool_evicts_one_block_not_the_conversation() -> None:
    tree = HybridRadixTree(8, 4)
    conv = chain("abcdefgh")
    store(tree, conv, states=(4, 8))
    host_only(tree, conv)
    assert tree.stats()["host_kv_free"] == 0
    assert tree.reserve_kv(chain("xyz"), None, 0) is not None
    stats = tree.stats()
    assert stats["kv_evicted"] == 1 and stats["kv_cascaded"] == 0
    assert stats["host_kv_used"] == 8  # 7 blocks of the conversation + the new reservation
    # Block 7 lost its only tier, so the state at 8 died with it; the state at 4 and the
    # blocks before the hole are still served from host.
    res = tree.match(conv)
    assert res.num_blocks == 4 == res.host_num_blocks
    assert NO_SLOT not in res.kv_slots and res.mamba_slot != NO_SLOT
    # Blocks 4..6 are still on host: a state stored at 7 makes all 7 blocks a host hit.
    slot = tree.reserve_mamba(conv, None, 7, from_device=False)
    tree.complete_store(mamba_slots=[slot])
    assert tree.match(conv).host_num_blocks == 7
    check_invariants(tree)


def test_evicted_block_with_a_storage_copy_keeps_the_state_after_it() -> None:
    tree = HybridRadixTree(8, 4)
    conv = chain("abcdefgh")
    store(tree, conv, states=(4, 8))
    tree.mark_storage(conv, None, 8)
    host_only(tree, conv)
    assert tree.reserve_kv(chain("xyz"), None, 0) is not None
    res = tree.match(conv)  # block 7 is still in storage: its prefix is whole, so is the state
    assert res.num_blocks == 8 and res.storage_blocks == [7] and res.host_num_blocks == 4
    assert res.mamba_slot != NO_SLOT
    check_invariants(tree)


def test_a_partially_evicted_conversation_stays_first_in_line() -> None:
    tree = HybridRadixTree(12, 4)
    older, newer = chain("abcdef"), chain("uvwxyz")
    store(tree, older, states=(2, 6))
    store(tree, newer, states=(6,))
    host_only(tree, older, newer)
    assert evict_host(tree, 1) == 1  # block 5 of the older conversation
    assert evict_host(tree, 2) == 2  # blocks 4, 3: it is still the least recently used
    assert tree.match(newer).host_num_blocks == 6  # untouched
    assert tree.match(older).num_blocks == 2  # its first turn survives
    assert tree.stats()["host_kv_used"] == 9
    check_invariants(tree)


def test_evict_host_frees_exactly_what_is_asked_across_conversations() -> None:
    tree = HybridRadixTree(12, 4)
    a, b = chain("abcd"), chain("wxyz")
    store(tree, a, states=(4,))
    store(tree, b, states=(4,))
    host_only(tree, a, b)
    assert evict_host(tree, 6) == 6  # all of a, then the last two blocks of b
    assert tree.stats()["host_kv_used"] == 2
    assert tree.match(a).num_blocks == 0 and tree.match(b).num_blocks == 0
    assert evict_host(tree, 5) == 2  # only what is left
    assert tree.stats()["nodes"] == 0
    check_invariants(tree)


# ---------------------------------------------------------------- node budget (metadata trim)
def _kept(tree: HybridRadixTree) -> int:
    """Nodes the budget may not drop: host bytes or held, and their ancestors."""
    keep: set[int] = set()
    for x in tree.iter_nodes():
        if x.n_host or x.mamba & 6 or x.held:  # HOST | PENDING
            while x.parent is not None and id(x) not in keep:
                keep.add(id(x))
                x = x.parent
    return len(keep)


def test_node_budget_bounds_metadata_and_leaves_host_hits_alone() -> None:
    budget = 24
    tree = HybridRadixTree(32, 16, max_nodes=budget)
    twin = HybridRadixTree(32, 16)  # same calls, no budget: what host hits must still be
    convs = [chain(f"c{r:03d}-abcd") for r in range(40)]
    for r in range(400):
        gpu, disk = chain(f"g{r:03d}+wxyz"), chain(f"s{r:03d}+pqrs")
        for t in (tree, twin):
            t.mark_device(gpu, None, 6, mamba=True)  # vLLM's own prefix of a request
            t.mark_storage(disk, None, 8, state_ends=[2, 5, 8])  # a probe answer
            if r % 10 == 0:  # a host write-through every few requests (pool pressure too)
                store(t, convs[r // 10], states=(5, 9))
            if r % 7 == 0:
                t.match(convs[(r // 7) % 40])
        assert tree.num_nodes <= max(budget, _kept(tree)), (tree.num_nodes, _kept(tree))
        if r % 50 == 0:
            check_invariants(tree)
    check_invariants(tree)
    assert twin.num_nodes > 10 * budget  # without a budget the metadata piles up
    assert tree.stats()["nodes_trimmed"] > 1000
    served = 0
    for conv in convs:
        got, want = tree.match(conv), twin.match(conv)
        assert (got.host_num_blocks, got.kv_slots, got.mamba_slot) == (
            want.host_num_blocks,
            want.kv_slots,
            want.mamba_slot,
        )
        served += got.host_num_blocks > 0
    assert served >= 3  # the comparison covered real host hits


def test_trimming_prefers_the_least_recently_seen_metadata() -> None:
    tree = HybridRadixTree(4, 4, max_nodes=3)
    old, mid, new = chain("aaa"), chain("bbb"), chain("ccc")
    for h in (old, mid, new):
        tree.mark_storage(h, None, 3, state_ends=[3])
    tree.mark_storage(old, None, 3, state_ends=[3])  # seen again: now the most recent
    tree.mark_storage(chain("ddd"), None, 3, state_ends=[3])  # a fourth node: one must go
    assert tree.match(mid).num_blocks == 0
    assert tree.match(old).num_blocks == 3 and tree.match(new).num_blocks == 3
    check_invariants(tree)


def test_budget_never_drops_a_pinned_storage_only_path() -> None:
    tree = HybridRadixTree(4, 4, max_nodes=3)
    h = chain("abcdef")
    tree.mark_storage(h, None, 6, state_ends=[2, 4, 6])  # three nodes: the whole budget
    pin = tree.pin(h, None, 6)
    for r in range(20):
        tree.mark_storage(chain(f"x{r}"), None, 1, state_ends=[1])
        check_invariants(tree)
    assert tree.match(h).num_blocks == 6  # pinned: held, never trimmed
    tree.unlock(pin)
    check_invariants(tree)
    tree.mark_storage(chain("yz"), None, 2, state_ends=[2])
    assert tree.num_nodes == 3
    assert tree.match(h).num_blocks == 4  # released: its least recently seen leaf went


def test_a_run_of_stores_reserves_in_one_walk_and_never_cuts_its_own_prefix() -> None:
    tree = HybridRadixTree(6, 4)
    a, b = chain(8, salt="a"), chain(2, salt="b")
    got = tree.reserve_kv_run(a, None, 0, 4)
    assert [i for i, _ in got] == [0, 1, 2, 3]
    tree.complete_store([s for _, s in got], [])
    store(tree, b)  # the pool is full now
    # Blocks 4..7 need 4 slots: a's own path is held for the run, so only b's two blocks
    # are victims (although a's node is the LRU leaf) and the run stops at block 6. Blocks
    # 6 and 7 are marked GPU (the request holds them), so no hole cuts the path.
    more = tree.reserve_kv_run(a, None, 4, 8)
    assert [i for i, _ in more] == [4, 5]
    tree.complete_store([s for _, s in more], [])
    check_invariants(tree)
    assert tree.depth(a, None) == 8 and host_blocks(tree, b, None) == []
    assert all(f for x in tree.iter_nodes() if x.hashes[0] == a[0] for f in x.flags)
    assert host_blocks(tree, a, None) == [0, 1, 2, 3, 4, 5]
    # Nothing but a's own blocks is left to evict: the next run stores nothing.
    assert tree.reserve_kv_run(a, None, 0, 8) == []
    assert host_blocks(tree, a, None) == [0, 1, 2, 3, 4, 5]
    check_invariants(tree)
