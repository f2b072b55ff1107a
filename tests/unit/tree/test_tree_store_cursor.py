"""A store cursor changes where the tree's walk starts, never what the tree becomes.

Two trees take the same random sequence of store runs, states, commits, roll-backs, host and
device evictions, storage marks, locks and resets; one is given cursors (each request's own,
another request's, or one left stale by evictions, splits and resets), the other none. After
every step both must be identical: shape, every flag, slot and lock, both LRUs' stamps and
both allocators. A cursor that the tree trusted wrongly (a node no longer on the path, or
ending elsewhere) would put blocks or a state on a node the walk from the root would not
reach, and the snapshots would differ.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from himamba.connector.tree import HybridRadixTree, StoreCursor, check_invariants
from himamba.connector.tree.node import Node
from tests.unit.tree.test_radix_tree_props import MAX_LEN, chain
from tests.unit.tree.tree_helpers import evict_device, evict_host, evict_host_mamba

KV_SLOTS, MAMBA_SLOTS = 10, 4

# A few recurring requests that share prefixes (so cursors are reused, go stale and cross
# paths), plus random ones.
POOL = [
    (None, [0, 0, 0, 0, 0, 0]),
    (None, [0, 0, 0, 1, 1, 0]),
    (None, [0, 1, 0, 1]),
    (None, [1, 1, 1, 1, 1]),
    ("salt-a", [0, 0, 0, 0, 0, 0]),
]
pooled = st.sampled_from(POOL)
requests = st.one_of(
    pooled,
    st.tuples(
        st.sampled_from([None, "salt-a"]),
        st.lists(st.integers(0, 1), min_size=1, max_size=MAX_LEN),
    ),
)
# Which cursor the second tree gets: the request's own, another's (shared pool), or a new one.
cursor_choice = st.sampled_from(["own", "own", "own", "other", "fresh"])


def snapshot(tree: HybridRadixTree) -> Any:
    """Everything a walk, a store or an eviction can change, in a comparable form."""

    def node(x: Node) -> tuple[Any, ...]:
        kids = sorted(x.child_nodes(), key=lambda c: c.hashes[0])
        return (
            x.start,
            tuple(x.hashes),
            bytes(x.flags),
            None if x.slots is None else tuple(x.slots),
            x.mamba,
            x.mamba_slot,
            x.tombstone,
            x.kv_lock,
            x.mamba_lock,
            x.kv_access,
            x.mamba_access,
            tuple(node(c) for c in kids),
        )

    roots = sorted(tree.forest.roots.items(), key=lambda kv: repr(kv[0]))
    return (
        [(repr(p), node(r)) for p, r in roots],
        tree.forest.num_nodes,
        sorted(tree.forest.pending_kv),
        sorted(tree.forest.pending_mamba),
        tree.stats(),
    )


class TwinMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.plain = HybridRadixTree(KV_SLOTS, MAMBA_SLOTS)
        self.fast = HybridRadixTree(KV_SLOTS, MAMBA_SLOTS)
        self.cursors: dict[tuple[object, tuple[int, ...]], StoreCursor] = {}
        self.pending: list[tuple[list[int], list[int]]] = []
        self.locks: list[tuple[Any, Any]] = []
        self.trusted = 0
        self.next: dict[tuple[object, tuple[int, ...]], int] = {}

    @initialize(budget=st.sampled_from([None, 4, 12]))
    def make_trees(self, budget) -> None:
        self.plain = HybridRadixTree(KV_SLOTS, MAMBA_SLOTS, max_nodes=budget)
        self.fast = HybridRadixTree(KV_SLOTS, MAMBA_SLOTS, max_nodes=budget)

    def _cursor(self, req, choice: str) -> StoreCursor:
        key = (req[0], tuple(req[1]))
        if choice == "fresh":
            return StoreCursor()
        if choice == "other" and self.cursors:
            return list(self.cursors.values())[len(req[1]) % len(self.cursors)]
        return self.cursors.setdefault(key, StoreCursor())

    def _both(self, call) -> tuple[Any, Any]:
        return call(self.plain, None), call(self.fast, True)

    @rule(req=requests, a=st.integers(0, MAX_LEN - 1), b=st.integers(1, MAX_LEN),
          settles=st.booleans(), choice=cursor_choice)  # fmt: skip
    def store_run(self, req, a, b, settles, choice) -> None:
        hashes, part = chain(req[1], salted=False), req[0]
        end = min(max(a + 1, b), len(hashes))
        start = min(a, end - 1)
        cur = self._cursor(req, choice)
        before = cur.node
        got_plain = self.plain.reserve_kv_run(hashes, part, start, end, settles)
        got_fast = self.fast.reserve_kv_run(hashes, part, start, end, settles, cursor=cur)
        assert got_plain == got_fast
        if before is not None and before.parent is not None and before.end == start:
            self.trusted += 1
        found = self.fast.forest.locate(hashes, part, end)
        if found is not None:  # (a node budget may trim a run that got no slot)
            assert cur.node is found[0]  # the cursor now holds block end - 1
        slots = [s for _, s in got_fast]
        if settles:  # the step plan's contract: commit (or roll back) in the same plan
            self.plain.complete_store(slots)
            self.fast.complete_store(slots)
        else:
            self.pending.append((slots, []))

    @rule(req=pooled, k=st.integers(1, 3), state=st.booleans())
    def continue_request(self, req, k, state) -> None:
        """What the scheduler does: the request's next run where its last one ended, the
        state at the run's end, both committed in the same plan."""
        hashes, part = chain(req[1], salted=False), req[0]
        key = (req[0], tuple(req[1]))
        start = self.next.get(key, 0)
        if start >= len(hashes):
            start = 0  # the request came back (a new turn with the same prompt)
        end = min(start + k, len(hashes))
        cur = self.cursors.setdefault(key, StoreCursor())
        forest = self.fast.forest
        origin = forest.on_path(cur.node, hashes, part, start) if start else forest.roots.get(part)
        if origin is not None:
            self.trusted += 1
            grows = origin.parent is not None and origin.kids is None and not origin.mamba
            room = self.fast.kv_slots.num_free >= end - start
            if not (origin.child(hashes[start]) or grows):
                NEW_LEAF["n"] += room
            elif grows and start:
                GROWN["n"] += room
        run_a = self.plain.reserve_kv_run(hashes, part, start, end, True)
        run_b = self.fast.reserve_kv_run(hashes, part, start, end, True, cursor=cur)
        assert run_a == run_b
        st_a = st_b = None
        if state:
            st_a = self.plain.reserve_mamba(hashes, part, end)
            st_b = self.fast.reserve_mamba(hashes, part, end, cursor=cur)
            assert st_a == st_b
        for tree, st_slot in ((self.plain, st_a), (self.fast, st_b)):
            tree.complete_store([s for _, s in run_a], [] if st_slot is None else [st_slot])
        self.next[key] = end

    @rule(req=requests, n=st.integers(1, MAX_LEN), dev=st.booleans(), choice=cursor_choice)
    def reserve_state(self, req, n, dev, choice) -> None:
        hashes, part = chain(req[1], salted=False), req[0]
        n = min(n, len(hashes))
        cur = self._cursor(req, choice)
        a = self.plain.reserve_mamba(hashes, part, n, from_device=dev)
        b = self.fast.reserve_mamba(hashes, part, n, from_device=dev, cursor=cur)
        assert a == b
        if a is not None:
            assert cur.node is not None and cur.node.end == n
            self.pending.append(([], [a]))

    @precondition(lambda self: self.pending)
    @rule(k=st.integers(1, 3), ok=st.booleans())
    def complete(self, k, ok) -> None:
        done, self.pending = self.pending[:k], self.pending[k:]
        kv = [s for d in done for s in d[0]]
        mb = [s for d in done for s in d[1]]
        self.plain.complete_store(kv, mb, ok=ok)
        self.fast.complete_store(kv, mb, ok=ok)

    @rule(req=requests, start=st.integers(0, 2))
    def lock(self, req, start) -> None:
        hashes, part = chain(req[1], salted=False), req[0]
        start = min(start, len(hashes))
        ra = self.plain.match(hashes, part, start, MAX_LEN)
        rb = self.fast.match(hashes, part, start, MAX_LEN)
        assert (ra.num_blocks, ra.kv_slots) == (rb.num_blocks, rb.kv_slots)
        if ra.num_blocks:
            self.locks.append((self.plain.lock(ra), self.fast.lock(rb)))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 10))
    def unlock(self, i) -> None:
        ha, hb = self.locks.pop(i % len(self.locks))
        self.plain.unlock(ha)
        self.fast.unlock(hb)

    @rule(n=st.integers(1, 4), states=st.booleans())
    def evict_host(self, n, states) -> None:
        for tree in (self.plain, self.fast):
            (evict_host_mamba if states else evict_host)(tree, n)

    @rule(req=requests, a=st.integers(0, MAX_LEN), b=st.integers(1, MAX_LEN))
    def evict_device(self, req, a, b) -> None:
        hashes, part = chain(req[1], salted=False), req[0]
        for tree in (self.plain, self.fast):
            evict_device(tree, hashes, part, a, b)

    @rule(req=requests, n=st.integers(1, MAX_LEN), ends=st.lists(st.integers(1, MAX_LEN)))
    def mark_storage(self, req, n, ends) -> None:
        hashes, part = chain(req[1], salted=False), req[0]
        n = min(n, len(hashes))
        for tree in (self.plain, self.fast):
            tree.mark_storage(hashes, part, n, [e for e in ends if e <= n])

    @rule(go=st.integers(0, 20))
    def reset(self, go) -> None:
        if go == 0:
            self.plain.reset()
            self.fast.reset()

    @rule()
    def seal_plan(self) -> None:
        self.plain.seal_plan()
        self.fast.seal_plan()

    @invariant()
    def identical(self) -> None:
        assert snapshot(self.plain) == snapshot(self.fast)
        check_invariants(self.fast)


TRUSTED = {"n": 0}
NEW_LEAF = {"n": 0}  # runs that took the one-new-leaf shortcut
GROWN = {"n": 0}  # runs that took the grow-the-stateless-leaf shortcut


class CountingTwin(TwinMachine):
    def teardown(self) -> None:
        TRUSTED["n"] += self.trusted


# Derandomized, as the property machine is: the counts below are asserted, and a random draw
# fell short of them once in CI (GROWN 27 of 30) with nothing wrong in the tree.
CountingTwin.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_cursor_never_changes_the_tree = CountingTwin.TestCase


def test_zz_cursors_were_trusted_often() -> None:
    """The twin run above exercised the fast paths, not only the fallback walk."""
    assert TRUSTED["n"] >= 150, TRUSTED
    assert NEW_LEAF["n"] >= 50, NEW_LEAF
    assert GROWN["n"] >= 30, GROWN
