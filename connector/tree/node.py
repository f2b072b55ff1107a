"""One node of the hybrid radix tree: a run of blocks plus the Mamba state at its end.

Tier presence is kept *per block* inside a node (a ``bytearray`` of bit flags) instead of
splitting a node whenever two blocks live in different tiers. Stores arrive one block at a
time and vLLM evicts GPU blocks in any order, so node-uniform tiers would shred every
conversation into one-block nodes; per-block flags keep nodes as long as the branching and
the Mamba boundaries allow, make a match cost O(nodes), not O(blocks), and let host eviction
free one block at a time from a node's end without reshaping the tree.

No vLLM import here: the tree is a pure data structure, testable on any machine.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence, ValuesView
from itertools import pairwise

# Tier bits, used both for a block's KV (``Node.flags[i]``) and for the Mamba state at the
# node end (``Node.mamba``).
GPU = 1  # mirrored from the scheduler: vLLM's paged cache holds it (may be stale or coarse)
HOST = 2  # committed in a pinned-CPU slot owned by the tree
PENDING = 4  # a host slot is reserved and a store is in flight: locked, not matchable
STORAGE = 8  # present in the storage tier (LMCache); the tree holds no bytes for it
LOADABLE = HOST | STORAGE  # what a hit may read beyond vLLM's own GPU prefix
ALL_TIERS = GPU | HOST | PENDING | STORAGE
NO_SLOT = -1


def _has(bit: int) -> bytes:
    """``bytes.translate`` table mapping a flag byte to 1 when it carries ``bit``: counting a
    node's blocks per tier then runs in C, which keeps multi-way splits linear."""
    return bytes(int(bool(v & bit)) for v in range(256))


_HAS_LOAD, _HAS_HOST, _HAS_PEND, _HAS_GPU = (_has(b) for b in (LOADABLE, HOST, PENDING, GPU))
_HAS_SLOT = _has(HOST | PENDING)
_OR_GPU = bytes(v | GPU for v in range(256))
# ``retag`` tables of a store's two moves: reserve (+PENDING), commit (-PENDING +HOST) and
# roll back (-PENDING).
RESERVE = bytes(v | PENDING for v in range(256))
COMMIT = bytes((v & ~PENDING) | HOST for v in range(256))
ROLLBACK = bytes(v & ~PENDING for v in range(256))


def _deltas(table: bytes) -> list[tuple[int, int, int, int, int] | None]:
    """Per old flag value: how (live, loadable, host, pending, gpu) counts move when the
    value becomes ``table[value]`` (None: they do not)."""

    def bits(v: int) -> tuple[int, ...]:
        return (int(v != 0), int(bool(v & LOADABLE)), int(bool(v & HOST)),
                int(bool(v & PENDING)), int(bool(v & GPU)))  # fmt: skip

    out: list[tuple[int, int, int, int, int] | None] = []
    for v in range(256):
        d = tuple(n - o for n, o in zip(bits(table[v]), bits(v), strict=True))
        out.append(d if any(d) else None)  # type: ignore[arg-type]
    return out


RETAG_TABLES = {t: _deltas(t) for t in (RESERVE, COMMIT, ROLLBACK)}


def common_prefix(a: Sequence[bytes], b: Sequence[bytes], pos: int, k: int) -> int:
    """How many of ``a[:k]`` equal ``b[pos:pos+k]``, given ``a[0] == b[pos]``.

    vLLM chains block hashes (hash ``i`` covers blocks ``0..i``), so two runs that agree on
    a hash agree on every earlier one: compare the last hash, binary-search on divergence."""
    if a[k - 1] == b[pos + k - 1]:
        return k
    lo, hi = 1, k - 1  # a[lo-1] matches, a[hi] does not
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] == b[pos + mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo


class Node:
    """A run of consecutive blocks on one path of the tree.

    ``start`` is the index of the node's first block in every request that reaches it, so
    the node's end boundary is ``start + len(hashes)``. ``slots[i]`` is the host KV slot of
    block ``start + i`` (``NO_SLOT`` unless ``HOST`` or ``PENDING``); it is allocated lazily
    because GPU-only and storage-only nodes never need it. Counters mirror the flags so that
    the common checks ("is every block of this node loadable?") are O(1).

    Locks follow the reference's split, kept apart: ``kv_lock`` counts loads and pins that
    read this node's host KV (taken on the whole path to the root, so a locked node's
    ancestors are locked too), ``mamba_lock`` counts loads reading the host Mamba state at
    this node's end (node only). In-flight stores are ``PENDING`` bits (``n_pend`` for KV,
    ``mamba & PENDING`` for the state). Recency stamps belong to the eviction policy:
    ``kv_access`` / ``mamba_access`` order its two lazy host LRUs (> 0: a member; see
    ``eviction.py`` for the other values), ``seen`` orders its metadata trim.

    ``kids`` is None (a leaf), the only child itself, or a dict first hash -> child once
    there are two or more: most nodes are links of one conversation's chain, and a one-entry
    dict per node cost more than the node's own blocks. Read it through ``child`` and
    ``child_nodes`` (``kids is None``: a leaf); only ``add_child`` / ``drop_child`` change it.
    """

    # What a match reads comes first: a node spans several cache lines, and at a million
    # blocks the walk's cost is mostly the lines it touches.
    __slots__ = (
        "kids",
        "hashes",
        "n_host",
        "n_load",
        "slots",
        "mamba",
        "parent",
        "kv_access",
        "kv_lock",
        "n_pend",
        "flags",
        "start",
        "mamba_slot",
        "mamba_access",
        "mamba_lock",
        "n_live",
        "n_gpu",
        "partition",
        "tombstone",
        "hits",
        "seen",
        "lru_id",
    )

    def __init__(
        self,
        parent: Node | None,
        partition: Hashable,
        start: int,
        hashes: list[bytes] | tuple[bytes, ...],
    ) -> None:
        self.parent = parent
        self.kids: Node | dict[bytes, Node] | None = None
        self.partition = partition
        self.start = start
        self.hashes = hashes
        self.flags = bytearray(len(hashes))
        self.slots: array | None = None
        self.n_live = self.n_load = self.n_host = self.n_pend = self.n_gpu = 0
        self.mamba = 0
        self.mamba_slot = NO_SLOT
        self.tombstone = False
        self.kv_lock = 0
        self.mamba_lock = 0
        self.hits = 0
        self.kv_access = 0
        self.mamba_access = 0
        self.lru_id = -1  # the eviction policy's handle on it while it has heap entries
        self.seen = 0

    def __len__(self) -> int:
        return len(self.hashes)

    def __repr__(self) -> str:
        return f"Node(start={self.start}, len={len(self.hashes)}, flags={bytes(self.flags)!r}, mamba={self.mamba})"

    @property
    def end(self) -> int:
        return self.start + len(self.hashes)

    def child(self, key: bytes) -> Node | None:
        """The child whose first block hash is ``key``, or None."""
        k = self.kids
        if k is None:
            return None
        if k.__class__ is dict:
            return k.get(key)  # type: ignore[union-attr]
        return k if k.hashes[0] == key else None  # type: ignore[union-attr,return-value]

    def child_nodes(self) -> Sequence[Node] | ValuesView[Node]:
        """Every child, in the order they were added (as a dict would keep them)."""
        k = self.kids
        if k is None:
            return ()
        if k.__class__ is dict:
            return k.values()  # type: ignore[union-attr]
        return (k,)  # type: ignore[return-value]

    def add_child(self, c: Node) -> None:
        """Link ``c`` under its first hash (replacing the child that had it)."""
        k, key = self.kids, c.hashes[0]
        if k is None:
            self.kids = c
        elif k.__class__ is dict:
            k[key] = c  # type: ignore[index]
        elif k.hashes[0] == key:  # type: ignore[union-attr]
            self.kids = c
        else:
            self.kids = {k.hashes[0]: k, key: c}  # type: ignore[union-attr,dict-item]

    def drop_child(self, c: Node) -> None:
        """Unlink the child ``c``."""
        k = self.kids
        if k is c:
            self.kids = None
            return
        assert k.__class__ is dict, "not a child"
        del k[c.hashes[0]]  # type: ignore[union-attr]
        if len(k) == 1:  # type: ignore[arg-type]
            self.kids = next(iter(k.values()))  # type: ignore[union-attr]

    @property
    def held(self) -> bool:
        """Something in flight reads or writes this node: cascades and trims must not touch it."""
        return bool(self.kv_lock or self.mamba_lock or self.n_pend or self.mamba & PENDING)

    def set_flag(self, i: int, new: int) -> None:
        """The only writer of ``flags``: keeps the counters exact."""
        old = self.flags[i]
        if old == new:
            return
        self.flags[i] = new
        self.n_live += (new != 0) - (old != 0)
        self.n_load += bool(new & LOADABLE) - bool(old & LOADABLE)
        self.n_host += bool(new & HOST) - bool(old & HOST)
        self.n_pend += bool(new & PENDING) - bool(old & PENDING)
        self.n_gpu += bool(new & GPU) - bool(old & GPU)

    def mark_gpu(self, upto: int) -> None:
        """Set ``GPU`` on blocks ``[0, upto)`` in one C-speed pass (a request's whole path is
        marked on every store run), counters exact as ``set_flag`` keeps them."""
        old = bytes(self.flags[:upto])
        self.flags[:upto] = old.translate(_OR_GPU)
        self.n_live += old.count(0)
        self.n_gpu += upto - old.translate(_HAS_GPU).count(1)

    def set_flags(self, idx: Sequence[int], new: bytes) -> None:
        """``set_flag(idx[k], new[k])`` for every k in one pass: a store run moves tens of
        blocks of one node at a time, and the counters move by C-speed counts."""
        f = self.flags
        old = bytes([f[i] for i in idx])
        for i, v in zip(idx, new, strict=True):
            f[i] = v
        self.n_live += old.count(0) - new.count(0)
        self.n_load += new.translate(_HAS_LOAD).count(1) - old.translate(_HAS_LOAD).count(1)
        self.n_host += new.translate(_HAS_HOST).count(1) - old.translate(_HAS_HOST).count(1)
        self.n_pend += new.translate(_HAS_PEND).count(1) - old.translate(_HAS_PEND).count(1)
        self.n_gpu += new.translate(_HAS_GPU).count(1) - old.translate(_HAS_GPU).count(1)

    def retag(self, a: int, b: int, table: bytes) -> None:
        """Map the flags of blocks ``[a, b)`` through ``table`` (one of ``RETAG_TABLES``) in
        C-speed passes, counters exact: a store run moves one contiguous span of a node
        almost always, so per-index bookkeeping (``set_flags``) is the exception. A span
        holds one or two distinct flag values, so the counters move once per distinct value
        by a precomputed delta."""
        f = self.flags
        old = bytes(f[a:b])
        f[a:b] = old.translate(table)
        deltas = RETAG_TABLES[table]
        for v in set(old):
            d = deltas[v]
            if d is not None:
                k = old.count(v)
                self.n_live += k * d[0]
                self.n_load += k * d[1]
                self.n_host += k * d[2]
                self.n_pend += k * d[3]
                self.n_gpu += k * d[4]

    def any_slot(self, a: int, b: int) -> bool:
        """Does a block of ``[a, b)`` hold a host slot (``HOST`` or ``PENDING``)?"""
        if not (self.n_host or self.n_pend):  # the usual answer for a store: O(1)
            return False
        return self.flags[a:b].translate(_HAS_SLOT).count(1) > 0

    def reserve_span(self, a: int, slots: Sequence[int]) -> None:
        """``reserve(range(a, a + len(slots)), slots)`` without a Python step per block."""
        b = a + len(slots)
        assert not self.any_slot(a, b), "block already has a host slot"
        self.retag(a, b, RESERVE)
        if self.slots is None:
            self.slots = array("i", [NO_SLOT]) * len(self.hashes)  # 4 bytes a block
        self.slots[a:b] = array("i", slots)

    def reserve(self, idx: Sequence[int], slots: Sequence[int]) -> None:
        """Blocks ``idx`` get host ``slots`` with a store in flight (``PENDING``). Only for
        blocks with neither ``HOST`` nor ``PENDING``."""
        f = self.flags
        assert not any(f[i] & (HOST | PENDING) for i in idx), "block already has a host slot"
        self.set_flags(idx, bytes([f[i] | PENDING for i in idx]))
        if self.slots is None:
            self.slots = array("i", [NO_SLOT]) * len(self.hashes)  # 4 bytes a block
        mine = self.slots
        for i, slot in zip(idx, slots, strict=True):
            mine[i] = slot

    def reserve_new(self, slots: Sequence[int]) -> None:
        """A node just created for a store run: every block is on GPU (the request holds
        it) with a store in flight into ``slots`` (one per block). What ``mark_gpu`` then
        ``reserve_span`` would leave, set at once."""
        n = len(self.hashes)
        assert len(slots) == n and not self.n_live, "only for a new node, one slot per block"
        self.flags = bytearray([GPU | PENDING]) * n
        self.n_live = self.n_gpu = self.n_pend = n
        self.slots = array("i", slots)

    def grow_reserved(self, hashes: list[bytes], slots: Sequence[int]) -> None:
        """Append blocks that are on GPU with a store in flight into ``slots`` (one per
        block): what ``extend``, ``mark_gpu`` and ``reserve_span`` would leave, at once."""
        n = len(hashes)
        assert len(slots) == n, "one slot per block"
        if self.hashes.__class__ is tuple:
            self.hashes = list(self.hashes)
        old = len(self.hashes)
        self.hashes.extend(hashes)  # type: ignore[union-attr]
        self.flags.extend(bytes([GPU | PENDING]) * n)
        if self.slots is None:
            self.slots = array("i", [NO_SLOT]) * old
        self.slots.extend(array("i", slots))
        self.n_live += n
        self.n_gpu += n
        self.n_pend += n

    def set_slot(self, i: int, slot: int) -> None:
        if self.slots is None:
            if slot == NO_SLOT:
                return
            self.slots = array("i", [NO_SLOT]) * len(self.hashes)  # 4 bytes a block
        self.slots[i] = slot

    def slot(self, i: int) -> int:
        return NO_SLOT if self.slots is None else self.slots[i]

    def recount(self) -> None:
        """Recompute the counters from the flags (after a split)."""
        f = self.flags
        self.n_live = len(f) - f.count(0)
        self.n_load = f.translate(_HAS_LOAD).count(1)
        self.n_host = f.translate(_HAS_HOST).count(1)
        self.n_pend = f.translate(_HAS_PEND).count(1)
        self.n_gpu = f.translate(_HAS_GPU).count(1)

    def extend(self, hashes: list[bytes]) -> None:
        """Append absent blocks to a stateless leaf (write-through grows one block at a time)."""
        if self.hashes.__class__ is tuple:
            self.hashes = list(self.hashes)
        self.hashes.extend(hashes)  # type: ignore[union-attr]
        self.flags.extend(bytes(len(hashes)))
        if self.slots is not None:
            self.slots.extend([NO_SLOT] * len(hashes))

    def seal(self) -> None:
        """A state now ends here, so the node stops growing: keep its hashes as a tuple,
        16 bytes less than a list (``extend`` turns it back into one if it ever grows)."""
        if self.hashes.__class__ is list:
            self.hashes = tuple(self.hashes)

    def split_at(self, cuts: Sequence[int]) -> list[Node]:
        """Cut before every index in ``cuts`` (ascending, each in ``(0, len)``) in one pass;
        return the new *heads*, top-down. ``self`` keeps the last piece.

        The tail keeps its identity, children, Mamba state, hit count and LRU entries, so
        handles and LRU heaps that point at it stay valid; heads join no LRU until the call
        settles them. Heads inherit ``kv_lock``: every load or pin locking the tail locked
        its whole path, and the heads are on that path.
        One pass costs O(len) however many cuts: a state marked at every block of a long
        node must not copy the node's tail once per cut.
        """
        n = len(self.hashes)
        assert cuts and 0 < cuts[0] and cuts[-1] < n, "cuts must leave every piece non-empty"
        parent = self.parent
        assert parent is not None
        heads: list[Node] = []
        bounds = [0, *cuts]
        for a, b in pairwise(bounds):
            assert a < b, "cuts must ascend"
            head = Node(parent, self.partition, self.start + a, tuple(self.hashes[a:b]))
            head.flags = self.flags[a:b]
            if self.slots is not None:
                head.slots = self.slots[a:b]
            head.recount()
            head.kv_lock = self.kv_lock
            head.hits = self.hits
            head.seen = self.seen
            parent.add_child(head)
            parent = head
            heads.append(head)
        last = cuts[-1]
        self.hashes = self.hashes[last:]
        self.flags = self.flags[last:]
        if self.slots is not None:
            self.slots = self.slots[last:]
        self.start += last
        self.recount()
        parent.add_child(self)
        self.parent = parent
        return heads
