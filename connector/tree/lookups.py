"""Read-mostly questions about paths: the longest hybrid hit of a request, how far it shares a
known path, and which host objects of a hit have become popular enough to write to storage
(selective write-through)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from himamba.tiers.object_format import ObjectKind

from .counters import TreeCounters
from .eviction import EvictionPolicy
from .forest import Forest
from .node import HOST, LOADABLE, NO_SLOT, STORAGE, Node, common_prefix
from .results import HotObject, MatchResult


def known_depth(forest: Forest, hashes: Sequence[bytes], partition: Hashable) -> int:
    """How many leading blocks of ``hashes`` the tree knows, in any tier or none."""
    node, pos = forest.roots.get(partition), 0
    while node is not None and pos < len(hashes):
        child = node.child(hashes[pos])
        if child is None:
            break
        k = min(len(child.hashes), len(hashes) - pos)
        m = common_prefix(child.hashes, hashes, pos, k)
        pos += m
        if m < len(child.hashes):
            break
        node = child
    return pos


def hot_objects(result: MatchResult, threshold: int) -> list[HotObject]:
    """Host blocks and the host state of a locked host hit that loads have used at least
    ``threshold`` times (this one included) and storage does not hold, now marked as in
    storage: the caller writes them while the hit's lock protects the slots. Only what proved
    popular costs storage traffic."""
    node = result._host_node
    out: list[HotObject] = []
    if node is None:
        return out
    if node.hits >= threshold and node.mamba & HOST and not node.mamba & STORAGE:
        node.mamba |= STORAGE
        out.append(HotObject(ObjectKind.MAMBA, node.mamba_slot, node.hashes[-1]))
    x: Node = node
    while x.parent is not None and x.end > result.start_block:
        if x.hits >= threshold and x.n_host:
            flags, slots = x.flags, x.slots
            assert slots is not None
            for i in range(max(result.start_block - x.start, 0), len(flags)):
                f = flags[i]
                if f & HOST and not f & STORAGE:
                    x.set_flag(i, f | STORAGE)
                    out.append(HotObject(ObjectKind.KV, slots[i], x.hashes[i]))
        x = x.parent
    return out


def longest_hit(
    forest: Forest,
    policy: EvictionPolicy,
    counters: TreeCounters,
    hashes: Sequence[bytes],
    partition: Hashable,
    start_block: int,
    limit: int,
) -> MatchResult:
    """``HybridRadixTree.match`` with ``limit`` resolved (at most ``len(hashes)``): the walk
    of every lookup, so it keeps its locals in the loop and reads each node once."""
    res = MatchResult(0, start_block, partition)
    node = forest.roots.get(partition)
    if node is None:
        counters.misses += 1
        return res
    # One walk: each node matched whole adds its slots to the plan as it goes, and the
    # plan is cut back to the deepest boundary with a state when the walk stops.
    hit: Node | None = None
    host_hit: Node | None = None
    hit_end = host_end = 0
    kv, storage, boundaries = res.kv_slots, res.storage_blocks, res.boundaries
    pos, all_host, dict_ = 0, True, dict
    while pos < limit:
        kids = node.kids
        if kids is None:
            break
        h = hashes[pos]
        if kids.__class__ is dict_:
            child = kids.get(h)  # type: ignore[union-attr]
            if child is None:
                break
        elif kids.hashes[0] == h:  # type: ignore[union-attr]
            child = kids  # type: ignore[assignment]
        else:
            break
        ch = child.hashes
        size = len(ch)
        if size > limit - pos or ch[-1] != hashes[pos + size - 1]:
            break  # the query ends or leaves this path inside the node (chained hashes)
        lo = start_block - pos
        if lo < size:  # not all of it is vLLM's own GPU hit
            first = lo if lo > 0 else 0
            slots = child.slots
            if child.n_host == size:  # all on host: the slots as they are, in C
                kv.extend(slots if first == 0 else slots[first:])  # type: ignore[arg-type]
            else:
                flags = child.flags
                if child.n_load != size:
                    i = first
                    while i < size and flags[i] & LOADABLE:
                        i += 1
                    if i < size:
                        break
                if all_host:
                    all_host = all(f & HOST for f in flags[first:])
                start = child.start
                for i in range(first, size):
                    if flags[i] & HOST:
                        kv.append(slots[i])  # type: ignore[index]
                    else:
                        kv.append(NO_SLOT)
                        storage.append(start + i)
        pos += size
        node = child
        m = child.mamba
        if m & LOADABLE and pos > start_block:
            on_host = m & HOST != 0
            boundaries.append((pos, on_host))
            hit, hit_end = child, pos
            if all_host and on_host:
                host_hit, host_end = child, pos
    if hit is None:
        kv.clear()
        storage.clear()
        counters.misses += 1
        return res
    # ``kv`` holds one slot per block from ``start_block`` on: cut it back to the hit.
    del kv[hit_end - max(start_block, 0) :]
    while storage and storage[-1] >= hit_end:
        storage.pop()
    counters.hits += 1
    res.num_blocks, res._node = hit_end, hit
    if host_hit is not None:
        res.host_num_blocks, res._host_node = host_end, host_hit
    if hit.mamba & HOST:
        res.mamba_slot = hit.mamba_slot
        policy.sync_mamba(hit, touch=True)
    else:
        res.mamba_in_storage = True
    policy.touch_path(hit)
    return res
