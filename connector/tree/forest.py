"""The shape of the hybrid radix tree: roots, paths, splits, and every index into nodes.

One root per partition (cache salt / LoRA), so a different salt never matches even if a
caller passes unchained hashes for the first block. ``Forest`` is the only code that changes
the shape (creates, splits, detaches nodes), so it also owns everything that points *into*
a node by position and must follow a reshape: the pending-store maps (slot -> node, index),
the set of nodes a reset condemned, the node count and the queue of split halves that the
maintenance pass must revalidate. It knows nothing about tiers' meaning, slots' bytes or
eviction order.

A reset sets every partition's remaining subtree (only held nodes keep content then) aside
under a ``Retired`` key that no caller can name: lookups and new stores of the same hashes
start from a fresh root, so a store committed after a reset is never dropped with the
pre-reset path it would otherwise have landed in, and the set-aside nodes go when released.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise, repeat

from .node import PENDING, Node, common_prefix


@dataclass(frozen=True)
class Retired:
    """The key (and every node's ``partition``) of a subtree a reset set aside: equal to no
    caller's partition, so nothing reaches it but what already held its nodes."""

    partition: Hashable
    number: int


def is_retired(x: Node) -> bool:
    """Whether ``x`` was set aside by a reset (its content is never served again)."""
    return x.partition.__class__ is Retired


class Forest:
    """Roots by partition plus the position-dependent indexes a split must keep exact."""

    def __init__(self) -> None:
        self.roots: dict[Hashable, Node] = {}
        self.num_nodes = 0
        # In-flight stores: host KV slot -> (node, block index in node); Mamba slot -> node.
        # KV runs reserved since the map was last read wait in ``_runs`` as (node, first
        # index, slots): a step plan commits most of them before anything reads the map, so
        # they never pay for one map entry per block (``pending_kv``, ``take_runs``).
        self._pending_kv: dict[int, tuple[Node, int]] = {}
        self._runs: list[tuple[Node, int, list[int]]] = []
        self.pending_mamba: dict[int, Node] = {}
        # Held nodes that a reset() condemned: set aside (``retire``), dropped when released.
        self.doomed: set[Node] = set()
        self.retirements = 0
        # Split tails whose pieces may have stopped being held: revalidated before the
        # public call returns (``Maintenance.flush``).
        self.dirty: list[Node] = []

    @property
    def pending_kv(self) -> dict[int, tuple[Node, int]]:
        """Every KV store in flight: slot -> (node, block index). Reading it enters the
        waiting runs first, so every reader sees them all."""
        if self._runs:
            self._enter_runs()
        return self._pending_kv

    def pend_span(self, node: Node, first: int, slots: list[int]) -> None:
        """Stores in flight into ``slots``, one per block of ``node`` from ``first`` on.
        Only recorded: a pending node is held (never cut short, dropped or merged), so
        ``(node, first)`` stays exact until a ``split`` of ``node``, which enters it first."""
        self._runs.append((node, first, slots))

    def pend_one(self, slot: int, node: Node, index: int) -> None:
        """A store in flight into ``slot`` for block ``index`` of ``node`` (waiting runs
        stay waiting: their slots are others)."""
        self._pending_kv[slot] = (node, index)

    def take_runs(self, slots: list[int]) -> tuple[list[tuple[Node, int, list[int]]], int, int]:
        """The waiting runs, removed, and where their slots lie in ``slots`` (``lo, hi``), if
        ``slots`` holds all of them in the order reserved, at its end or its start (a plan
        committing its own runs, after the single slots planned before them); else
        ``([], 0, 0)`` and nothing changes."""
        runs = self._runs
        if not runs:
            return [], 0, 0
        total = sum(len(r[2]) for r in runs)
        for lo in (len(slots) - total, 0):
            if lo < 0:
                break
            n = lo
            for _, _, run_slots in runs:
                k = len(run_slots)
                if slots[n : n + k] != run_slots:
                    break
                n += k
            else:
                self._runs = []
                return runs, lo, n
        return [], 0, 0

    def _enter_runs(self) -> None:
        entries = self._pending_kv
        for node, first, slots in self._runs:
            n = len(slots)
            entries.update(
                zip(slots, zip(repeat(node, n), range(first, first + n), strict=True), strict=True)
            )
        self._runs = []

    def locate(
        self, hashes: Sequence[bytes], partition: Hashable, end: int
    ) -> tuple[Node, int] | None:
        """The node holding block ``end - 1`` and its index there, without changing the tree."""
        node, pos = self.roots.get(partition), 0
        while node is not None and pos < end:
            child = node.child(hashes[pos])
            if child is None:
                return None
            k = min(len(child.hashes), end - pos)
            if common_prefix(child.hashes, hashes, pos, k) < k:
                return None
            pos += k
            if pos == end:
                return child, k - 1
            node = child
        return None

    def ensure_path(
        self,
        hashes: Sequence[bytes],
        partition: Hashable,
        end: int,
        cuts: Sequence[int] = (),
        origin: Node | None = None,
    ) -> list[Node]:
        """Create the path of blocks ``[0, end)`` with a node boundary at every value of
        ``cuts`` (ascending, each in ``1..end``); return its nodes top-down, the last one
        holding block ``end - 1``. New blocks have no tier yet.

        ``origin``: a node of this path that ends before ``end`` (the caller checked it with
        ``on_path``); the walk starts after it and the nodes up to it are left out of the
        result. The shape produced is the same as from the root.

        One walk whatever the number of cuts: O(nodes on the path + cuts + new blocks)."""
        if origin is None:
            node = self.roots.get(partition)
            if node is None:
                node = self.roots[partition] = Node(None, partition, 0, [])
            pos = 0
        else:
            node, pos = origin, origin.start + len(origin.hashes)
        path: list[Node] = []
        ci, nc = 0, len(cuts)
        while pos < end:
            child = node.child(hashes[pos])
            if child is None:
                break
            size = len(child.hashes)
            m = common_prefix(child.hashes, hashes, pos, min(size, end - pos))
            while ci < nc and cuts[ci] <= pos:
                ci += 1
            inner: list[int] = []
            while ci < nc and cuts[ci] - pos < size and cuts[ci] - pos <= m:
                inner.append(cuts[ci] - pos)
                ci += 1
            if m < min(size, end - pos) and (not inner or inner[-1] != m):
                inner.append(m)  # the request diverges inside: it branches off at m
            if inner:
                path += self.split(child, inner)
                if inner[-1] < m:
                    path.append(child)
            else:
                path.append(child)
            node = path[-1]
            pos += m
            if m < size:
                break
        if pos < end:
            while ci < nc and cuts[ci] < pos:
                ci += 1
            state_at_pos = (ci < nc and cuts[ci] == pos) or (ci > 0 and cuts[ci - 1] == pos)
            rest = [c for c in cuts[ci:] if pos < c < end]
            bounds = [pos, *rest, end]
            grow = (
                node.parent is not None
                and node.kids is None
                and not node.mamba
                and not state_at_pos  # a state goes at pos: the node must keep ending there
            )
            for a, b in pairwise(bounds):
                if grow:  # extend a stateless leaf in place (write-through: one block a time)
                    node.extend(list(hashes[a:b]))
                    node.tombstone = False
                    grow = False
                    if not path:  # it is ``origin``: now it holds blocks past it
                        path.append(node)
                    continue
                child = Node(node, partition, a, list(hashes[a:b]))
                node.add_child(child)
                self.num_nodes += 1
                path.append(child)
                node = child
        return path

    @staticmethod
    def on_path(
        x: Node | None, hashes: Sequence[bytes], partition: Hashable, end: int
    ) -> Node | None:
        """``x`` if it is the tree's node holding blocks up to exactly ``end`` of this path
        (what ``locate`` would find, ending there), else None. Attached nodes have attached
        ancestors (only leaves are detached) and hashes are chained, so its last hash and
        its end place it."""
        if (
            x is not None
            and x.parent is not None
            and x.start + len(x.hashes) == end
            and x.partition == partition
            and x.hashes[-1] == hashes[end - 1]
        ):
            return x
        return None

    def split(self, node: Node, cuts: Sequence[int]) -> list[Node]:
        """Cut ``node`` before each offset in ``cuts``; return the new heads top-down."""
        pending = self.pending_kv  # enters waiting runs now: rewritten below, not after
        heads = node.split_at(cuts)
        self.num_nodes += len(heads)
        for part in (*heads, node):
            if part.n_pend:
                slots = part.slots
                assert slots is not None
                for i, f in enumerate(part.flags):
                    if f & PENDING:
                        pending[slots[i]] = (part, i)
        self.dirty.append(node)
        return heads

    def retire(self) -> list[Node]:
        """Set every live partition's subtree aside under a new ``Retired`` key (a reset,
        once everything unheld is gone); return the nodes set aside now, roots excluded."""
        moved: list[Node] = []
        for key in [k for k in self.roots if k.__class__ is not Retired]:
            root = self.roots.pop(key)
            self.retirements += 1
            tag = Retired(key, self.retirements)
            root.partition = tag
            stack = list(root.child_nodes())
            while stack:
                x = stack.pop()
                x.partition = tag
                moved.append(x)
                stack.extend(x.child_nodes())
            self.roots[tag] = root
        return moved

    def detach(self, x: Node) -> Node:
        """Unlink the leaf ``x``; return its former parent (an emptied root goes too)."""
        parent = x.parent
        assert parent is not None and x.kids is None
        parent.drop_child(x)
        x.parent = None
        self.num_nodes -= 1
        self.doomed.discard(x)
        if parent.parent is None and parent.kids is None:
            del self.roots[parent.partition]
        return parent

    def iter_nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children."""
        stack = [c for r in self.roots.values() for c in r.child_nodes()]
        while stack:
            x = stack.pop()
            yield x
            stack.extend(x.child_nodes())
