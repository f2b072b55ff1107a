"""Invariant checker for ``HybridRadixTree``: the oracle of the property tests.

Every check recomputes from scratch what the tree maintains incrementally (counters, LRU and
trim-order membership, lock and pin counts, pool usage, the node budget), so an
incremental-update bug shows up as a named mismatch right after the step that caused it, not
as a crash hours later (the reference's lessons:
sgl-project/sglang#12007, sgl-project/sglang#27147, sgl-project/sglang#36696,
sgl-project/sglang#27489).
O(tree size): call it in tests and leak reports, not per request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .eviction import QUEUED, kv_evictable, mamba_evictable, trimmable
from .forest import Retired, is_retired
from .node import ALL_TIERS, GPU, HOST, LOADABLE, NO_SLOT, PENDING, Node

if TYPE_CHECKING:
    from .slot_allocator import SlotAllocator
    from .tree import HybridRadixTree

logger = logging.getLogger(__name__)


def _check(cond: bool, invariant: str, detail: object) -> None:
    if not cond:
        raise AssertionError(f"invariant violated [{invariant}]: {detail}")


def invariants_hold(tree: HybridRadixTree) -> bool:
    """``check_invariants`` for a report: False (the violation logged) instead of raising."""
    try:
        check_invariants(tree)
    except AssertionError as exc:
        logger.error("himamba: tree invariant broken: %s", exc)
        return False
    return True


def check_invariants(tree: HybridRadixTree) -> None:
    """Raise ``AssertionError`` naming the first violated invariant."""
    forest = tree.forest
    nodes: list[Node] = []
    _check(not forest.dirty, "settled", "split halves left unsettled after a call")
    # --- children map, lengths, partitions (sglang note §2 items 4, 5)
    for key, root in forest.roots.items():
        retired = key.__class__ is Retired  # only what was held at the reset keeps content
        _check(root.parent is None and not root.hashes, "root", root)
        _check(root.partition == key, "partition", (key, root.partition))
        _check(root.kids is not None, "no-empty-root", key)
        _check(root.kv_lock == 0 and root.mamba_lock == 0 and not root.mamba, "root", root)
        _check_kids(root)
        stack: list[tuple[Node, Node, bool]] = [(c, root, True) for c in root.child_nodes()]
        while stack:
            x, p, prefix_live = stack.pop()
            nodes.append(x)
            _check(x.parent is p, "children-map", "child.parent is not its parent")
            _check(bool(x.hashes), "no-empty-node", x)
            _check(p.child(x.hashes[0]) is x, "children-map", "stale child key")
            _check_kids(x)
            _check(x.start == p.start + len(p.hashes), "lengths", "start != parent end")
            _check(x.partition == p.partition, "partition", x)
            _check(len(x.flags) == len(x.hashes), "lengths", "flags")
            _check(x.slots is None or len(x.slots) == len(x.hashes), "lengths", "slots")
            _check_node(x, prefix_live)
            if retired:
                _check(x.held or not (x.n_live or x.mamba), "reset", f"set-aside content {x}")
            child_live = prefix_live and x.n_live == len(x.hashes)
            stack.extend((c, x, child_live) for c in x.child_nodes())
    for x in forest.doomed:
        _check(x.parent is not None and x.held, "reset", f"doomed node not held/attached {x}")
        # Unreachable by any lookup or store: a reset set its subtree aside.
        _check(is_retired(x), "reset", f"doomed node still under a live root {x}")
    _check(len(nodes) == forest.num_nodes, "size-accounting", (len(nodes), forest.num_nodes))
    _check_pools_and_pending(tree, nodes)
    _check_lru(tree, nodes)
    _check_budget(tree, nodes)
    _check_locks(tree, nodes)


def _check_kids(x: Node) -> None:
    """``kids`` is None, the one child, or a dict of two or more keyed by first hash."""
    k = x.kids
    if isinstance(k, dict):
        _check(len(k) >= 2, "children-map", "a dict of fewer than two children")
        for h, c in k.items():
            _check(isinstance(c, Node) and c.hashes[0] == h, "children-map", "child key")
    else:
        _check(k is None or isinstance(k, Node), "children-map", f"kids {type(k)}")


def _check_node(x: Node, prefix_live: bool) -> None:
    """Tier presence, counters, state-at-node-end and invariant P for one node."""
    live = load = host = pend = gpu = 0
    for i, f in enumerate(x.flags):
        _check(f & ~ALL_TIERS == 0, "tier-presence", f"unknown bits {f}")
        _check(not (f & HOST and f & PENDING), "tier-presence", "block both committed and pending")
        has_slot = x.slots is not None and x.slots[i] != NO_SLOT
        _check(has_slot == bool(f & (HOST | PENDING)), "tier-presence", f"slot vs flags at {i}")
        live += f != 0
        load += bool(f & LOADABLE)
        host += bool(f & HOST)
        pend += bool(f & PENDING)
        gpu += bool(f & GPU)
    got = (x.n_live, x.n_load, x.n_host, x.n_pend, x.n_gpu)
    _check(got == (live, load, host, pend, gpu), "size-accounting", ("counters", got))
    m = x.mamba
    _check(m & ~ALL_TIERS == 0, "mamba-state", f"unknown bits {m}")
    _check(not (m & HOST and m & PENDING), "mamba-state", "state both committed and pending")
    _check((x.mamba_slot != NO_SLOT) == bool(m & (HOST | PENDING)), "mamba-state", "slot vs bits")
    _check(not (x.tombstone and m & (HOST | PENDING)), "mamba-state", "tombstone holds a state")
    has_content = bool(x.n_live or m)
    if x.kids is None:
        _check(has_content or x.held, "pruning", f"empty unheld leaf {x}")
    if not x.held and has_content:
        # P: every block with a tier and the state at the end have a live prefix.
        _check(prefix_live, "prefix-closure", f"content under a dead prefix {x}")
        hole = x.flags.find(0)
        if hole >= 0:
            _check(not any(x.flags[hole:]), "prefix-closure", f"content after hole {hole} {x}")
            _check(not m, "prefix-closure", "state at the end of a node with a hole")


def _check_pools_and_pending(tree: HybridRadixTree, nodes: list[Node]) -> None:
    """Pool conservation (free + quarantined + used = size) for host KV and host Mamba, no
    slot both free and quarantined, none in use by a node and given up; pending maps."""
    forest = tree.forest
    kv_used: set[int] = set()
    mamba_used: set[int] = set()
    pend_blocks = pend_states = 0
    for x in nodes:
        for i, f in enumerate(x.flags):
            if f & (HOST | PENDING):
                s = x.slots[i]  # type: ignore[index]
                _check(s not in kv_used, "pool-conservation", f"KV slot {s} used twice")
                _check(_in_use(tree.kv_slots, s), "pool-conservation", f"KV slot {s} not in use")
                kv_used.add(s)
            if f & PENDING:
                pend_blocks += 1
                _check(forest.pending_kv.get(x.slots[i]) == (x, i), "pending", "KV entry")  # type: ignore[index]
        if x.mamba & (HOST | PENDING):
            s = x.mamba_slot
            _check(s not in mamba_used, "pool-conservation", f"Mamba slot {s} used twice")
            _check(_in_use(tree.mamba_slots, s), "pool-conservation", f"Mamba slot {s} not in use")
            mamba_used.add(s)
        if x.mamba & PENDING:
            pend_states += 1
            _check(forest.pending_mamba.get(x.mamba_slot) is x, "pending", "Mamba entry")
    _check(pend_blocks == len(forest.pending_kv), "pending", "stale KV pending entries")
    _check(pend_states == len(forest.pending_mamba), "pending", "stale Mamba pending entries")
    for alloc, used, name in (
        (tree.kv_slots, kv_used, "KV"),
        (tree.mamba_slots, mamba_used, "Mamba"),
    ):
        free, held = alloc.free_slots(), alloc.quarantined_slots()
        _check(len(set(free)) == len(free), "pool-conservation", f"{name} free list duplicates")
        _check(len(set(held)) == len(held), "pool-conservation", f"{name} quarantine duplicates")
        _check(not set(free) & set(held), "pool-conservation", f"{name} free and quarantined")
        _check(all(alloc.is_free(s) for s in free), "pool-conservation", f"{name} free state")
        _check(
            all(alloc.is_quarantined(s) for s in held),
            "pool-conservation",
            f"{name} quarantine state",
        )
        _check(
            len(free) + len(held) + len(used) == alloc.capacity,
            "pool-conservation",
            f"{name}: free {len(free)} + quarantined {len(held)} + used {len(used)}"
            f" != size {alloc.capacity}",
        )
        _check(alloc.num_used == len(used), "pool-conservation", f"{name} used count")


def _in_use(alloc: SlotAllocator, slot: int) -> bool:
    return not alloc.is_free(slot) and not alloc.is_quarantined(slot)


def _check_lru(tree: HybridRadixTree, nodes: list[Node]) -> None:
    """Membership, one heap entry per node no later than its stamp (so eviction reaches every
    member in stamp order), distinct stamps, and 'descendants before ancestors'."""
    policy = tree.policy
    seen: dict[tuple[str, int], int] = {}
    for which, stamp, x in policy.lru_entries():
        access = x.kv_access if which == "kv" else x.mamba_access
        _check(access != 0, "lru-heap", f"{which} entry of a node marked as having none")
        _check((which, id(x)) not in seen, "lru-heap", f"two {which} entries for one node")
        seen[(which, id(x))] = stamp
        _check(access < 0 or stamp <= access, "lru-heap", f"{which} entry after its stamp")
    holders = {nid for _, nid in seen}
    _check(len(holders) == policy.ids_in_use(), "lru-heap", "ids held by nodes without entries")
    for x in nodes:
        _check((x.lru_id >= 0) == (id(x) in holders), "lru-heap", f"lru_id {x.lru_id}")
        for which, access in (("kv", x.kv_access), ("mamba", x.mamba_access)):
            _check(access >= QUEUED, "lru-heap", f"{which} stamp {access}")
            _check((access != 0) == ((which, id(x)) in seen), "lru-heap", f"{which} entry mark")
    order = policy.kv_members()
    want_kv = {id(x) for x in nodes if kv_evictable(x)}
    have_kv = [id(x) for x in order]
    _check(set(have_kv) == want_kv, "lru-membership", "host KV LRU != evictable host nodes")
    for x in nodes:
        if x.kv_access > 0:
            _check(id(x) in want_kv, "lru-membership", "a host KV stamp outside the LRU")
    pos = {nid: i for i, nid in enumerate(have_kv)}
    last = -1
    for x in order:
        _check(x.kv_access > last, "lru-order", "host KV LRU stamps not distinct")
        last = x.kv_access
        a = x.parent
        while a is not None and id(a) not in pos:
            a = a.parent
        if a is not None:  # the nearest evictable ancestor (order is transitive)
            _check(pos[id(a)] > pos[id(x)], "leaf-set", "ancestor evictable before descendant")
    want_m = {id(x) for x in nodes if mamba_evictable(x)}
    morder = policy.mamba_members()
    _check({id(x) for x in morder} == want_m, "lru-membership", "host Mamba LRU")
    for x in nodes:
        if x.mamba_access > 0:
            _check(id(x) in want_m, "lru-membership", "a host Mamba stamp outside the LRU")
    last = -1
    for x in morder:
        _check(x.mamba_access > last, "lru-order", "host Mamba LRU stamps not distinct")
        last = x.mamba_access


def _check_budget(tree: HybridRadixTree, nodes: list[Node]) -> None:
    """Invariant B, and that the trim order can reach every metadata leaf."""
    meta = [x for x in nodes if trimmable(x)]
    if tree.max_nodes is not None and len(nodes) > tree.max_nodes:
        _check(not meta, "budget", f"{len(nodes)} nodes > {tree.max_nodes} with {meta[:3]}")
    if tree.policy.track_trim:
        live = {id(x) for stamp, x in tree.policy.trim_entries() if stamp == x.seen}
        for x in meta:
            _check(id(x) in live, "trim-order", f"metadata leaf not queued for trimming {x}")


def _check_locks(tree: HybridRadixTree, nodes: list[Node]) -> None:
    """Lock counts equal what the live handles (loads and pins) say they locked; path locks
    are monotone; a handle's state lock is on its own node."""
    kv: dict[int, int] = {}
    mamba: dict[int, int] = {}
    for h in tree.handles:
        _check(not h.released, "locks", "released handle still registered")
        x = h.kv_node
        _check(x is not None and x.parent is not None, "locks", "handle on a detached node")
        _check(h.mamba_node is None or h.mamba_node is x, "locks", "state lock off the kv node")
        while x is not None and x.parent is not None:
            kv[id(x)] = kv.get(id(x), 0) + 1
            x = x.parent
        if h.mamba_node is not None:
            mamba[id(h.mamba_node)] = mamba.get(id(h.mamba_node), 0) + 1
    for x in nodes:
        _check(x.kv_lock == kv.get(id(x), 0), "locks", f"kv_lock {x.kv_lock} != handles")
        _check(x.mamba_lock == mamba.get(id(x), 0), "locks", f"mamba_lock {x.mamba_lock}")
        _check(not x.mamba_lock or x.mamba & HOST, "locks", "mamba lock without a host state")
        if x.parent is not None and x.parent.parent is not None:
            _check(x.kv_lock <= x.parent.kv_lock, "locks", "locked node under unlocked parent")
