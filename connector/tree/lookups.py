"""Read-mostly questions about paths: how far a request shares a known path, and which host
objects of a hit have become popular enough to write to storage (selective write-through)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from himamba.tiers.object_format import ObjectKind

from .forest import Forest
from .node import HOST, STORAGE, Node, common_prefix
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
