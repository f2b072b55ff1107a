"""Stateful property test: random insert / match / lock / pin / unlock / evict / mark / complete
/ seal sequences on tiny pools, with and without a node budget and a write-back policy, every
invariant checked after every step, plus oracles the checker cannot see alone: a match is
exactly the deepest hybrid boundary (and lists every boundary below it), locked and pinned
data never moves, host eviction frees exactly the blocks asked for, a storage mark with states
reaches every block and state it names, a store run never evicts its own request's host
blocks, a quarantined slot stays out of use until the plan is sealed, and the free journal
names every slot that left the tree (and, over a run, exactly as many as were allocated)."""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from himamba.connector.tree import (
    HOST,
    LOADABLE,
    NO_SLOT,
    STORAGE,
    HybridRadixTree,
    LockHandle,
    StoreCursor,
    check_invariants,
)
from himamba.connector.tree.eviction import kv_evictable
from tests.unit.tree.tree_helpers import (
    block_flags,
    evict_device,
    evict_host,
    evict_host_mamba,
    is_doomed,
    slots_in_use,
    state_bits,
)

KV_SLOTS, MAMBA_SLOTS, MAX_LEN = 12, 5, 6
STEPS = {"n": 0}

# A request = (partition, tokens); tokens is a short path over a 2-letter alphabet so
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


Locked = tuple[LockHandle, list[bytes], object, int, int, list[int], int]


def block_at(node: object, b: int) -> tuple[object, int]:
    """The node on ``node``'s path (it or an ancestor) holding block ``b``, and the index."""
    x = node
    while x.start > b:  # type: ignore[attr-defined]
        x = x.parent  # type: ignore[attr-defined]
    return x, b - x.start  # type: ignore[attr-defined]


class TreeMachine(RuleBasedStateMachine):
    stored = Bundle("stored")

    def __init__(self) -> None:
        super().__init__()
        self.tree = HybridRadixTree(KV_SLOTS, MAMBA_SLOTS)
        self.kv_pending: list[int] = []
        self.mamba_pending: list[int] = []
        # handle -> (hashes, partition, start, n, slots, mamba slot) as seen at lock time
        self.locked: list[Locked] = []
        # Free-journal oracle: slots in use after the last step, allocations and journal
        # entries over the run, and the quarantine as of the last step (same plan unless sealed).
        self.in_use: tuple[set[int], set[int]] = (set(), set())
        self.allocated = [0, 0]
        self.journaled = [0, 0]
        self.quarantined: tuple[set[int], set[int]] = (set(), set())
        self.sealed = False
        # Slots written back since the last seal: the worker reads them in this plan.
        self.written: tuple[set[int], set[int]] = (set(), set())
        self.write_all = False

    @initialize(
        budget=st.sampled_from([None, 4, 10]), write_back=st.sampled_from([None, "some", "all"])
    )
    def make_tree(self, budget, write_back) -> None:
        """Half the runs have a node budget small enough to trim on most steps; two thirds
        write victims back (their slots are quarantined until a seal)."""
        self.tree = HybridRadixTree(KV_SLOTS, MAMBA_SLOTS, max_nodes=budget)
        self.tree.journal_frees = True
        if write_back is not None:
            self.write_all = write_back == "all"
            self.tree.write_back = self._write_back

    def _write_back(self, is_state: bool, slot: int, block_hash: bytes, partition: object) -> bool:
        """All victims, or about half of them (deterministic), go to storage first."""
        if self.write_all or (slot + block_hash[0]) % 2 == 0:
            self.written[is_state].add(slot)
            return True
        return False

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
        # Oracle: deepest boundary with loadable KV on [start, n) and a state at n, and
        # every boundary on the way that has a loadable state.
        want, bounds = 0, []
        for n in range(start + 1, limit + 1):
            if not block_flags(self.tree, hashes, part, n - 1) & LOADABLE:
                break
            m = state_bits(self.tree, hashes, part, n)
            if m & LOADABLE:
                want = n
                bounds.append((n, bool(m & HOST)))
        assert res.num_blocks == want, (res, want)
        assert res.boundaries == bounds, (res.boundaries, bounds)
        if want:
            assert len(res.kv_slots) == want - start
            for j, s in enumerate(res.kv_slots):
                f = block_flags(self.tree, hashes, part, start + j)
                assert (s != NO_SLOT) == bool(f & HOST)
            assert res.host_num_blocks <= res.num_blocks
            if take:  # lock 3 hits out of 4: loads in flight are the hard part
                h = self.tree.lock(res, count_hit=take != 2)  # some are a request's retry
                assert h is not None and not h.pinned
                self.locked.append((h, hashes, part, start, want, res.kv_slots, res.mamba_slot))

    @rule(req=stored, n=st.integers(1, MAX_LEN))
    def pin(self, req, n) -> None:
        """A prefetch pins the prefix it extends: its host blocks must not move until unpin."""
        hashes, part = self._req(req)
        n = min(n, len(hashes))
        found = self.tree.forest.locate(hashes, part, n)
        if found is None:
            try:
                self.tree.pin(hashes, part, n)
            except KeyError:
                return
            raise AssertionError("pin of a path that is not in the tree")
        h = self.tree.pin(hashes, part, n)
        assert h.pinned and h.kv_node is found[0]
        slots = []
        for b in range(n):
            f = self.tree.forest.locate(hashes, part, b + 1)
            assert f is not None
            slots.append(f[0].slot(f[1]) if f[0].flags[f[1]] & HOST else NO_SLOT)
        mslot = NO_SLOT if h.mamba_node is None else h.mamba_node.mamba_slot
        self.locked.append((h, hashes, part, 0, n, slots, mslot))

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
            self.allocated[0] += 1

    @rule(req=requests, a=st.integers(0, MAX_LEN - 1), b=st.integers(1, MAX_LEN))
    def reserve_kv_run(self, req, a, b) -> None:
        """A request stores a run of its blocks: its host blocks stay put while it does."""
        hashes, part = self._req(req)
        end = min(max(a + 1, b), len(hashes))
        start = min(a, end - 1)
        tree = self.tree
        before = [i for i in range(end) if block_flags(tree, hashes, part, i) & HOST]
        got = tree.reserve_kv_run(hashes, part, start, end)
        self.kv_pending += [s for _, s in got]
        self.allocated[0] += len(got)
        for i in before:
            assert block_flags(tree, hashes, part, i) & HOST, ("own block evicted", i, before)
        assert all(start <= i < end for i, _ in got)

    @rule(
        req=requests,
        cut=st.integers(1, MAX_LEN),
        lone=st.one_of(st.none(), requests),
        between=st.sampled_from(["none", "split", "evict", "mark", "stats"]),
        drop=st.integers(0, 2),
    )
    def plan(self, req, cut, lone, between, drop) -> None:
        """What one step plan does: a single slot planned first (a partial tail), then a
        request's runs with its cursor, a state at each run end, maybe something in between
        (a state inside a run: a split; an eviction; a storage mark; a read of the pending
        map), the last ``drop`` slots rolled back (nothing to copy), the rest committed in
        plan order. Every committed block is then on host in the slot it was reserved."""
        hashes, part = self._req(req)
        tree = self.tree
        kv: list[int] = []
        placed: list[tuple[int, int]] = []
        if lone is not None:
            lh, lp = self._req(lone)
            slot = tree.reserve_kv(lh, lp, len(lh) - 1)
            if slot is not None:
                kv.append(slot)
        cursor = StoreCursor()
        states: list[int] = []
        bounds = sorted({min(cut, len(hashes)), len(hashes)})
        start = 0
        for end in bounds:
            if end <= start:
                continue
            got = tree.reserve_kv_run(hashes, part, start, end, True, cursor)
            placed += got
            kv += [s for _, s in got]
            state = tree.reserve_mamba(hashes, part, end, cursor=cursor)
            if state is not None:
                states.append(state)
            start = end
        if between == "split" and len(hashes) > 1:
            state = tree.reserve_mamba(hashes, part, 1)
            if state is not None:
                states.append(state)
        elif between == "evict":
            evict_host(tree, 1)
        elif between == "mark":
            tree.mark_storage(hashes, part, len(hashes))
        elif between == "stats":
            assert tree.stats()["pending_stores"] >= len(kv) + len(states)
        self.allocated[0] += len(kv)
        self.allocated[1] += len(states)
        dropped = kv[len(kv) - drop :] if drop else []
        if dropped:
            tree.complete_store(dropped, [], ok=False)
        tree.complete_store(kv[: len(kv) - len(dropped)], states, ok=True)
        for i, slot in placed:
            if slot in dropped:
                continue
            found = tree.forest.locate(hashes, part, i + 1)
            assert found is not None, ("committed block gone", i)
            node, j = found
            assert node.flags[j] & HOST and node.slot(j) == slot, ("block", i, slot)

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
        self.allocated[0] += sum(s is not None for s in kv)
        self.allocated[1] += sum(s is not None for s in mb)
        return req

    @rule(req=requests, n=st.integers(1, MAX_LEN), dev=st.booleans())
    def reserve_mamba(self, req, n, dev) -> None:
        hashes, part = self._req(req)
        slot = self.tree.reserve_mamba(hashes, part, min(n, len(hashes)), from_device=dev)
        if slot is not None:
            self.mamba_pending.append(slot)
            self.allocated[1] += 1

    @precondition(lambda self: self.kv_pending or self.mamba_pending)
    @rule(k=st.integers(1, 4), ok=st.integers(0, 3))
    def complete(self, k, ok) -> None:
        kv, self.kv_pending = self.kv_pending[:k], self.kv_pending[k:]
        mb, self.mamba_pending = self.mamba_pending[:k], self.mamba_pending[k:]
        self.tree.complete_store(kv, mb, ok=ok != 0)

    @rule(n=st.integers(1, 4))
    def evict_host(self, n) -> None:
        """Per-block eviction: exactly ``n`` host blocks go while enough are evictable."""
        tree = self.tree
        evictable = sum(x.n_host for x in tree.iter_nodes() if kv_evictable(x))
        used = tree.stats()["host_kv_used"]
        freed = evict_host(tree, n)
        assert freed == min(n, evictable), (freed, n, evictable)
        assert used - tree.stats()["host_kv_used"] == freed

    @rule(n=st.integers(1, 2))
    def evict_host_mamba(self, n) -> None:
        evict_host_mamba(self.tree, n)

    @rule(req=requests, n=st.integers(1, MAX_LEN), m=st.booleans())
    def mark_device(self, req, n, m) -> None:
        hashes, part = self._req(req)
        self.tree.mark_device(hashes, part, min(n, len(hashes)), mamba=m)

    @rule(req=requests, n=st.integers(1, MAX_LEN), ends=st.lists(st.integers(1, MAX_LEN)))
    def mark_storage(self, req, n, ends) -> None:
        """A probe answer in one walk: every named block and state is in storage after it
        (unless the budget trimmed it right away, or a reset condemned the path)."""
        hashes, part = self._req(req)
        n = min(n, len(hashes))
        ends = [e for e in ends if e <= n]
        tree = self.tree
        # Marks landing on a path a reset condemned go with it (conservative, never wrong).
        condemned = any(
            f is not None and is_doomed(tree, f[0])
            for f in (tree.forest.locate(hashes, part, b) for b in range(1, n + 1))
        )
        tree.mark_storage(hashes, part, n, ends)
        for b in range(1, n + 1):
            if condemned:
                break
            found = tree.forest.locate(hashes, part, b)
            if found is None:
                assert tree.max_nodes is not None, "a marked block vanished without a budget"
            elif not is_doomed(tree, found[0]):
                assert found[0].flags[found[1]] & STORAGE
                if b in ends:
                    assert found[0].end == b and found[0].mamba & STORAGE

    @rule(req=requests, a=st.integers(0, MAX_LEN), b=st.integers(1, MAX_LEN), storage=st.booleans())
    def evict_tier(self, req, a, b, storage) -> None:
        hashes, part = self._req(req)
        if storage:
            self.tree.evict_storage(hashes, part, a, b)
        else:
            evict_device(self.tree, hashes, part, a, b)

    @rule(go=st.integers(0, 30))
    def reset(self, go) -> None:
        if go == 0:
            self.tree.reset()

    @rule()
    def seal_plan(self) -> None:
        """The scheduler sealed a step plan: its write-back victims' slots are free now."""
        self.tree.seal_plan()
        assert self.tree.stats()["host_kv_quarantined"] == 0
        assert self.tree.stats()["host_mamba_quarantined"] == 0
        self.sealed = True
        self.written = (set(), set())

    def _check_journal_and_quarantine(self) -> None:
        """Every slot that left the tree since the last step is journaled; a quarantined
        slot stays quarantined (and so unused) until the plan is sealed."""
        tree = self.tree
        now = slots_in_use(tree)
        freed = tree.take_freed()
        quarantined = (
            set(tree.kv_slots.quarantined_slots()),
            set(tree.mamba_slots.quarantined_slots()),
        )
        for k in (0, 1):
            gone = self.in_use[k] - now[k]
            assert gone <= set(freed[k]), ("freed slot not journaled", k, gone, freed[k])
            self.journaled[k] += len(freed[k])
            if not self.sealed:
                assert self.quarantined[k] <= quarantined[k], ("quarantine left early", k)
            assert not quarantined[k] & now[k], ("quarantined slot in use", k)
            assert not self.written[k] & now[k], ("written-back slot reused in its plan", k)
        self.in_use, self.quarantined, self.sealed = now, quarantined, False

    @invariant()
    def holds(self) -> None:
        STEPS["n"] += 1
        check_invariants(self.tree)
        self._check_journal_and_quarantine()
        for h, hashes, _part, start, n, slots, mslot in self.locked:
            # Walked up from the locked node, not located from the root: a reset sets the
            # locked path aside, where no lookup reaches it, but it must stay put there too.
            for j, s in enumerate(slots):
                if s != NO_SLOT:  # locked / pinned host KV stays exactly where it was
                    x, i = block_at(h.kv_node, start + j)
                    assert x.hashes[i] == hashes[start + j] and x.slot(i) == s
            if mslot != NO_SLOT:
                assert h.mamba_node is not None and h.mamba_node.end == n
                assert h.mamba_node.mamba_slot == mslot

    def teardown(self) -> None:
        for h, *_ in self.locked:
            self.tree.unlock(h)
        self.tree.complete_store(self.kv_pending, self.mamba_pending, ok=True)
        check_invariants(self.tree)
        self.tree.reset()
        check_invariants(self.tree)
        self._check_journal_and_quarantine()
        # Every slot ever allocated has left the tree now, each journaled exactly once.
        assert self.journaled == self.allocated, (self.journaled, self.allocated)
        self.tree.seal_plan()
        st_ = self.tree.stats()
        assert st_["host_kv_used"] == 0 and st_["host_mamba_used"] == 0, st_
        assert st_["host_kv_free"] == KV_SLOTS and st_["host_mamba_free"] == MAMBA_SLOTS, st_
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
