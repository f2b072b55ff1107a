"""Setting and clearing one tier's bit along a request's path (GPU and storage mirror).

vLLM and storage tell the tree about tiers it does not own: blocks in vLLM's paged cache,
objects a storage probe found or lost. Setting a bit walks the path once however many state
boundaries it carries; clearing one cascades from the first block left with no tier at all
(invariant P, ``maintenance.py``). The tree calls these and then finishes its public call.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from .eviction import EvictionPolicy
from .forest import Forest
from .maintenance import Maintenance
from .node import GPU, Node, common_prefix


def fill_absent(node: Node, upto: int, bit: int) -> None:
    """Give ``bit`` to every tier-less block of the path before ``node[upto]``."""
    x: Node | None = node
    while x is not None and x.parent is not None:
        if x.n_live < len(x.hashes):
            i = x.flags.find(0, 0, upto)
            while 0 <= i:
                x.set_flag(i, bit)
                i = x.flags.find(0, i + 1, upto)
        x = x.parent
        upto = len(x.hashes) if x is not None else 0


def mark_gpu_up(node: Node) -> None:
    """``GPU`` on every block of ``node`` and of its ancestors: a request storing blocks past
    ``node`` holds this whole prefix in its block table."""
    x = node
    while x.parent is not None:
        if x.n_gpu < len(x.hashes):
            x.mark_gpu(len(x.hashes))
        x = x.parent


def mark_path(
    forest: Forest,
    policy: EvictionPolicy,
    hashes: Sequence[bytes],
    partition: Hashable,
    num_blocks: int,
    bit: int,
    ends: Sequence[int],
) -> None:
    """Give ``bit`` to blocks ``[0, num_blocks)`` and to the state at each of ``ends``."""
    if not 1 <= num_blocks <= len(hashes):
        raise IndexError(num_blocks)
    path = forest.ensure_path(hashes, partition, num_blocks, ends)
    j = 0
    for x in path:
        upto = min(len(x.hashes), num_blocks - x.start)
        if bit != GPU or x.n_gpu < len(x.hashes):
            flags = x.flags
            for i in range(upto):
                x.set_flag(i, flags[i] | bit)
        if j < len(ends) and ends[j] == x.end:
            x.mamba |= bit
            x.seal()
            x.tombstone = False
            j += 1
    assert j == len(ends), "ensure_path must end a node at every state boundary"
    policy.touch_path(path[-1], kv=False)


def clear_path(
    forest: Forest,
    maint: Maintenance,
    hashes: Sequence[bytes],
    partition: Hashable,
    start: int,
    end: int | None,
    bit: int,
) -> None:
    end = len(hashes) if end is None else min(end, len(hashes))
    node, pos = forest.roots.get(partition), 0
    hole: tuple[Node, int] | None = None
    while node is not None and pos < end:
        child = node.child(hashes[pos])
        if child is None:
            break
        k = common_prefix(child.hashes, hashes, pos, min(len(child.hashes), end - pos))
        for i in range(max(start - pos, 0), k):
            child.set_flag(i, child.flags[i] & ~bit)
            if hole is None and not child.flags[i]:
                hole = (child, i)
        if start < child.end <= end:
            child.mamba &= ~bit
        if k < len(child.hashes):
            break
        pos += k
        node = child
    if hole is not None:
        maint.kill_from(hole[0], hole[1] + 1)
    elif node is not None and node.parent is not None:
        maint.prune(node)
