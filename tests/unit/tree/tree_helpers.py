"""Test-only operations on a ``HybridRadixTree`` that production code never needs.

vLLM tells a connector nothing when it drops GPU blocks, so the connector never clears GPU
marks; tests do, to make the host copy a block's only tier. Hit counts are read by the tree's
own ``hot_objects``; tests read them directly. ``chain`` and ``store`` build the hashes and
the write-through every tree test starts from. ``block_flags``, ``state_bits`` and
``slots_in_use`` read the tree as the oracles of the property machine see it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

from himamba.connector.tree import GPU, HOST, PENDING, HybridRadixTree, check_invariants
from himamba.connector.tree.node import Node
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


def evict_host(tree: HybridRadixTree, num_blocks: int) -> int:
    """Free ``num_blocks`` host KV slots as a store short of slots would (the LRU host leaf's
    end first); returns how many were freed."""
    freed = tree.evictor.evict_kv(num_blocks)
    tree._finish()
    return freed


def evict_host_mamba(tree: HybridRadixTree, num_states: int) -> int:
    """Free up to ``num_states`` LRU host Mamba states (leaving tombstones)."""
    freed = tree.evictor.evict_states(num_states)
    tree._finish()
    return freed


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


def chain(tokens: str | int, salt: str = "") -> list[bytes]:
    """vLLM-style chained block hashes, one per token; an int makes that many blocks."""
    items = [str(i) for i in range(tokens)] if isinstance(tokens, int) else list(tokens)
    out, prev = [], salt.encode()
    for t in items:
        prev = hashlib.sha256(prev + t.encode()).digest()
        out.append(prev)
    return out


def store(tree: HybridRadixTree, hashes: list[bytes], part=None, states=(), ok=True) -> None:
    """Write-through of a request: every block plus Mamba states at ``states`` boundaries,
    then the invariants."""
    kv = [tree.reserve_kv(hashes, part, i) for i in range(len(hashes))]
    mb = [tree.reserve_mamba(hashes, part, n) for n in states]
    tree.complete_store([s for s in kv if s is not None], [s for s in mb if s is not None], ok)
    check_invariants(tree)


def is_doomed(tree: HybridRadixTree, x: Node | None) -> bool:
    """Held across a reset(): never served, nor anything below it."""
    while x is not None:
        if x in tree.forest.doomed:
            return True
        x = x.parent
    return False


def block_flags(tree: HybridRadixTree, hashes: list[bytes], part: object, i: int) -> int:
    """Block ``i``'s tier flags as a hit would see them (0: absent or condemned by a reset)."""
    found = tree.forest.locate(hashes, part, i + 1)
    if found is None or is_doomed(tree, found[0]):
        return 0
    return found[0].flags[found[1]]


def state_bits(tree: HybridRadixTree, hashes: list[bytes], part: object, n: int) -> int:
    """The tiers of the Mamba state at boundary ``n`` (0: none there, or condemned)."""
    found = tree.forest.locate(hashes, part, n)
    if found is None or found[0].end != n or is_doomed(tree, found[0]):
        return 0
    return found[0].mamba


def slots_in_use(tree: HybridRadixTree) -> tuple[set[int], set[int]]:
    """Host KV and Mamba slots that some node holds (committed or pending)."""
    kv: set[int] = set()
    mamba: set[int] = set()
    for x in tree.iter_nodes():
        for i, f in enumerate(x.flags):
            if f & (HOST | PENDING):
                kv.add(x.slot(i))
        if x.mamba & (HOST | PENDING):
            mamba.add(x.mamba_slot)
    return kv, mamba
