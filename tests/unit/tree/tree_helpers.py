"""Test-only operations on a ``HybridRadixTree`` that production code never needs.

vLLM tells a connector nothing when it drops GPU blocks, so the connector never clears GPU
marks; tests do, to make the host copy a block's only tier. Hit counts are read by the tree's
own ``hot_objects``; tests read them directly. Import as ``unit.tree.tree_helpers`` (the
``tests`` folder is on ``sys.path``; this folder has no ``__init__.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from himamba.connector.tree import GPU, HOST, HybridRadixTree
from himamba.connector.tree.tier_marks import clear_path


def evict_device(
    tree: HybridRadixTree,
    hashes: Sequence[bytes],
    partition: Hashable,
    start_block: int = 0,
    end_block: int | None = None,
) -> None:
    """vLLM dropped blocks ``[start_block, end_block)`` (and states ending in that range)."""
    clear_path(tree.forest, tree.maint, hashes, partition, start_block, end_block, GPU)
    tree._finish()  # every public call of the tree ends with it (invariants P and B)


def hit_count(
    tree: HybridRadixTree, hashes: Sequence[bytes], partition: Hashable, block_index: int
) -> int:
    """How many counted loads used block ``block_index`` (``lock(..., count_hit=True)``)."""
    found = tree.forest.locate(hashes, partition, block_index + 1)
    return 0 if found is None else found[0].hits


def host_blocks(tree: HybridRadixTree, hashes: Sequence[bytes], partition: Hashable) -> list[int]:
    """Indices of the blocks of ``hashes`` the tree holds on host (committed), ascending."""
    out = []
    for i in range(len(hashes)):
        found = tree.forest.locate(hashes, partition, i + 1)
        if found is not None and found[0].flags[found[1]] & HOST:
            out.append(i)
    return out
