"""Stateful property test: random insert / match / lock / unlock / evict / complete sequences
on tiny pools, every invariant checked after every step, plus two oracles the checker cannot
see alone: a match is exactly the deepest hybrid boundary, and locked data never moves."""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from himamba.connector.radix_tree import HybridRadixTree, LockHandle
from himamba.connector.tree_invariants import check_invariants
from himamba.connector.tree_node import HOST, LOADABLE, NO_SLOT

KV_SLOTS, MAMBA_SLOTS, MAX_LEN = 12, 5, 6
STEPS = {"n": 0}

# A request = (partition, tokens); tokens is a short path over a 3-letter alphabet so
# prefixes are shared and branch often.
requests = st.tuples(
    st.sampled_from([None, "salt-a"]),
    st.lists(st.integers(0, 1), min_size=1, max_size=MAX_LEN),
)


def chain(tokens: list[int], salted: bool) -> list[bytes]:
    """vLLM-style chained block hashes (the partition is *not* folded in when not salted,
    so only the tree's partitioning keeps the two apart)."""
    out, prev = [], b"salt" if salted else b""
    for t in tokens:
        prev = hashlib.blake2b(prev + bytes([t]), digest_size=8).digest()
        out.append(prev)
    return out


def _block(tree: HybridRadixTree, hashes: list[bytes], part: object, i: int) -> int:
    found = tree._locate(hashes, part, i + 1)
    if found is None:
        return 0
    x = found[0]
    while x is not None:
        if x in tree.doomed:  # held across a reset(): never served, nor anything below
            return 0
        x = x.parent
    return found[0].flags[found[1]]


def _state(tree: HybridRadixTree, hashes: list[bytes], part: object, n: int) -> int:
    found = tree._locate(hashes, part, n)
    if found is None or found[0].end != n:
        return 0
    return found[0].mamba


class TreeMachine(RuleBasedStateMachine):
    stored = Bundle("stored")

    def __init__(self) -> None:
        super().__init__()
        self.tree = HybridRadixTree(KV_SLOTS, MAMBA_SLOTS)
        self.kv_pending: list[int] = []
        self.mamba_pending: list[int] = []
        # handle -> (hashes, partition, start, n, slots, mamba slot) as seen at lock time
        self.locked: list[tuple[LockHandle, list[bytes], object, int, int, list[int], int]] = []

    def _req(self, req: tuple[object, list[int]]) -> tuple[list[bytes], object]:
        part, tokens = req
        return chain(tokens, salted=False), part

    @rule(
        req=requests, start=st.integers(0, 3), cap=st.integers(1, MAX_LEN), take=st.integers(0, 3)
    )
    def match(self, req, start, cap, take) -> None:
        self._match(req, start, cap, take)

    @rule(req=stored, more=st.integers(0, 1), start=st.integers(0, 2), take=st.integers(0, 3))
    def match_stored(self, req, more, start, take) -> None:
        """Re-ask for a stored request (plus one new block): where hits and locks happen."""
        self._match((req[0], req[1] + [0] * more), start, MAX_LEN, take)

    def _match(self, req, start, cap, take) -> None:
        hashes, part = self._req(req)
        start = min(start, len(hashes))
        res = self.tree.match(hashes, part, start, cap)
        limit = min(cap, len(hashes))
        # Oracle: deepest boundary with loadable KV on [start, n) and a state at n.
        want = 0
        for n in range(start + 1, limit + 1):
            if not _block(self.tree, hashes, part, n - 1) & LOADABLE:
                break
            if _state(self.tree, hashes, part, n) & LOADABLE:
                want = n
        assert res.num_blocks == want, (res, want)
        if want:
            assert len(res.kv_slots) == want - start
            for j, s in enumerate(res.kv_slots):
                f = _block(self.tree, hashes, part, start + j)
                assert (s != NO_SLOT) == bool(f & HOST)
            assert res.host_num_blocks <= res.num_blocks
            if take:  # lock 3 hits out of 4: loads in flight are the hard part
                h = self.tree.lock(res)
                assert h is not None
                self.locked.append((h, hashes, part, start, want, res.kv_slots, res.mamba_slot))

    @precondition(lambda self: self.locked)
    @rule(i=st.integers(0, 100))
    def unlock(self, i) -> None:
        h = self.locked.pop(i % len(self.locked))[0]
        self.tree.unlock(h)

    @rule(req=requests, i=st.integers(0, MAX_LEN - 1), dev=st.booleans())
    def reserve_kv(self, req, i, dev) -> None:
        hashes, part = self._req(req)
        slot = self.tree.reserve_kv(hashes, part, min(i, len(hashes) - 1), from_device=dev)
        if slot is not None:
            self.kv_pending.append(slot)

    @rule(target=stored, req=requests, mid=st.integers(1, MAX_LEN), ok=st.integers(0, 5))
    def store_request(self, req, mid, ok):
        """The connector's write-through of a whole request: every block, the states at a
        mid boundary and at the end, committed together (or rolled back)."""
        hashes, part = self._req(req)
        kv = [self.tree.reserve_kv(hashes, part, i) for i in range(len(hashes))]
        mb = [
            self.tree.reserve_mamba(hashes, part, n) for n in {min(mid, len(hashes)), len(hashes)}
        ]
        self.tree.complete_store(
            [s for s in kv if s is not None], [s for s in mb if s is not None], ok=ok != 0
        )
        return req

    @rule(req=requests, n=st.integers(1, MAX_LEN), dev=st.booleans())
    def reserve_mamba(self, req, n, dev) -> None:
        hashes, part = self._req(req)
        slot = self.tree.reserve_mamba(hashes, part, min(n, len(hashes)), from_device=dev)
        if slot is not None:
            self.mamba_pending.append(slot)

    @precondition(lambda self: self.kv_pending or self.mamba_pending)
    @rule(k=st.integers(1, 4), ok=st.integers(0, 3))
    def complete(self, k, ok) -> None:
        kv, self.kv_pending = self.kv_pending[:k], self.kv_pending[k:]
        mb, self.mamba_pending = self.mamba_pending[:k], self.mamba_pending[k:]
        self.tree.complete_store(kv, mb, ok=ok != 0)

    @rule(n=st.integers(1, 4))
    def evict_host(self, n) -> None:
        self.tree.evict_host(n)

    @rule(n=st.integers(1, 2))
    def evict_host_mamba(self, n) -> None:
        self.tree.evict_host_mamba(n)

    @rule(req=requests, n=st.integers(1, MAX_LEN), m=st.booleans(), storage=st.booleans())
    def mark(self, req, n, m, storage) -> None:
        hashes, part = self._req(req)
        n = min(n, len(hashes))
        if storage:
            self.tree.mark_storage(hashes, part, n, mamba=m)
        else:
            self.tree.mark_device(hashes, part, n, mamba=m)

    @rule(req=requests, a=st.integers(0, MAX_LEN), b=st.integers(1, MAX_LEN), storage=st.booleans())
    def evict_tier(self, req, a, b, storage) -> None:
        hashes, part = self._req(req)
        if storage:
            self.tree.evict_storage(hashes, part, a, b)
        else:
            self.tree.evict_device(hashes, part, a, b)

    @rule(go=st.integers(0, 30))
    def reset(self, go) -> None:
        if go == 0:
            self.tree.reset()

    @invariant()
    def holds(self) -> None:
        STEPS["n"] += 1
        check_invariants(self.tree)
        for _h, hashes, part, start, n, slots, mslot in self.locked:
            for j, s in enumerate(slots):
                if s != NO_SLOT:  # locked host KV stays exactly where the load reads it
                    found = self.tree._locate(hashes, part, start + j + 1)
                    assert found is not None and found[0].slot(found[1]) == s
            if mslot != NO_SLOT:
                found = self.tree._locate(hashes, part, n)
                assert found is not None and found[0].mamba_slot == mslot

    def teardown(self) -> None:
        for h, *_ in self.locked:
            self.tree.unlock(h)
        self.tree.complete_store(self.kv_pending, self.mamba_pending, ok=True)
        check_invariants(self.tree)
        self.tree.reset()
        check_invariants(self.tree)
        st_ = self.tree.stats()
        assert st_["host_kv_used"] == 0 and st_["host_mamba_used"] == 0, st_
        assert st_["nodes"] == 0 and st_["locks"] == 0 and st_["pending_stores"] == 0


TreeMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestTreeMachine = TreeMachine.TestCase


def test_zz_property_run_covered_at_least_10k_steps() -> None:
    """Runs after the machine (file order): the CI budget of >= 10,000 checked operations."""
    if STEPS["n"] == 0:  # collected alone: nothing to assert
        return
    assert STEPS["n"] >= 10_000, STEPS["n"]
