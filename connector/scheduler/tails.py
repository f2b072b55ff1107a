"""Partial tails: a finished request's last, partly filled block and the Mamba state after its
very last computed token, so the next turn of a conversation hits through the whole previous
answer instead of stopping at its last full block.

A hit normally ends on a block boundary, where vLLM hands over a Mamba state. A conversation's
next prompt is the previous prompt plus the answer plus a new message, so that boundary is up
to a block short of what was computed: with production block sizes (hundreds of tokens) that
is a large part of the next turn's prefill. When a request finishes with ``T`` computed tokens,
``T = P * block_size + L`` with ``0 < L < block_size``, its block ``P`` holds the KV of those
``L`` tokens and its running Mamba state is exactly the state after ``T`` tokens (align mode:
the running state lives in column ``P``). vLLM frees the blocks at once; both are copied to the
CPU tier in the next step's first worker hook (``StepPlan.early_stores``), before that step's
forward computes into any block (on a GPU the compute stream waits for the copy). Model Runner
V1 (the CPU platform's) calls that hook before it zeroes or copies any block, so a freed block
is read before it is reused (vLLM hands out uncached blocks, such as a tail's, first); V2 (a
GPU engine's default) writes the step's new blocks first, so there the copy runs from
himamba's step-start hook (``vllm_fixups.runner_v2_hook``), which precedes V2's step. Without
that hook, a tail whose blocks the step hands out is given up (``drop_overwritten``: the next
turn hits to its last full block). Nothing is held: a reset with running requests preempted,
which vLLM refuses (raises) while a finished request holds blocks, still succeeds.

In the tree a tail is an ordinary one-block node under block ``P - 1``, named by a *tail hash*
of its parent's block hash and its ``L`` tokens (never equal to a real block hash), with a
state at its end: eviction, locks, invariants and loads treat it like any other block. A
lookup whose tokens continue the parent with the same ``L`` tokens loads ``P`` full blocks,
the tail's page and its state, and vLLM resumes at token ``T``, not on a block boundary (as
it does after a disaggregated-prefill load). Only the tail's tokens must match: bytes past
``L`` in its page are never read (attention stops at the sequence length, and the resumed
prefill overwrites them).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from himamba.connector.layout import GroupLayout, HybridLayout
from himamba.connector.protocol import ObjectKind, StepPlan, StoreBatch
from himamba.connector.scheduler.counters import SchedulerCounters
from himamba.connector.scheduler.host_stores import block_hashes
from himamba.connector.tree import HybridRadixTree, MatchResult
from himamba.tiers.object_format import StorageKey
from himamba.tiers.storage_records import TaskResult

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# Tail hashes live in the tree beside vLLM's block hashes: a domain prefix keeps them apart.
_DOMAIN = b"himamba-tail-v1\x00"
# Parents remembered with their tails (tail hash -> length). A forgotten or evicted tail only
# stops hitting; its slots are the tree's, which evicts them like any block.
MAX_PARENTS = 8192


def tail_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The name of the tail that continues block hash ``parent`` with ``tokens`` (fixed-width
    tokens, then their count: unambiguous, and every prefix's name costs one more update)."""
    h = hashlib.blake2b(_DOMAIN, digest_size=32)
    h.update(parent)
    h.update(array("q", tokens).tobytes())
    h.update(len(tokens).to_bytes(4, "little"))
    return h.digest()


def tail_candidates(parent: bytes, tokens: Sequence[int]) -> list[bytes]:
    """``tail_hash(parent, tokens[:n])`` for n = 1 .. len(tokens): the names a tail under
    ``parent`` could have for a request continuing with ``tokens`` (a storage probe cannot
    list a parent's tails, so it asks for each length)."""
    h = hashlib.blake2b(_DOMAIN, digest_size=32)
    h.update(parent)
    out = []
    for n, token in enumerate(tokens, 1):
        h.update(token.to_bytes(8, "little", signed=True))
        c = h.copy()
        c.update(n.to_bytes(4, "little"))
        out.append(c.digest())
    return out


@dataclass(frozen=True)
class TailHit:
    """A tail that a request's tokens continue: blocks ``[0, parent_blocks)`` then ``length``
    tokens named ``tail``."""

    parent_blocks: int
    length: int
    tail: bytes


class TailIndex:
    """Which tails were stored under which parent block hash (most recent parents kept)."""

    def __init__(self, max_parents: int = MAX_PARENTS) -> None:
        self._by_parent: OrderedDict[tuple[Hashable, bytes], dict[bytes, int]] = OrderedDict()
        self._max = max_parents

    def add(self, partition: Hashable, parent: bytes, tail: bytes, length: int) -> None:
        key = (partition, parent)
        tails = self._by_parent.get(key)
        if tails is None:
            tails = self._by_parent[key] = {}
            if len(self._by_parent) > self._max:
                self._by_parent.popitem(last=False)
        else:
            self._by_parent.move_to_end(key)
        tails[tail] = length

    def best(
        self,
        partition: Hashable,
        hashes: Sequence[bytes],
        tokens: Sequence[int],
        block_size: int,
        first: int,
        limit: int,
    ) -> TailHit | None:
        """The deepest tail this request continues that ends past ``first`` blocks and at most
        ``limit`` tokens in (the last prompt token is always recomputed)."""
        if not self._by_parent:
            return None
        last = min(len(hashes), limit // block_size)
        for p in range(last, max(first, 1) - 1, -1):
            tails = self._by_parent.get((partition, hashes[p - 1]))
            if not tails:
                continue
            base = p * block_size
            best: TailHit | None = None
            for tail, length in tails.items():
                if base + length > limit or (best is not None and length <= best.length):
                    continue
                if tail_hash(hashes[p - 1], tokens[base : base + length]) == tail:
                    best = TailHit(p, length, tail)
            if best is not None:
                return best
        return None

    def __len__(self) -> int:
        return len(self._by_parent)

    def clear(self) -> None:
        self._by_parent.clear()


@dataclass
class TailProbe:
    """A storage probe for the tail past a request's stored blocks: one name per length."""

    parent_blocks: int
    names: list[bytes]  # names[i]: the tail of length i + 1
    block_states: bool  # the block probe found a state to hit at anyway

    def keys(self, salt: str) -> list[StorageKey]:
        """Each candidate's KV page, then each one's state (the order of the answer)."""
        kv = [StorageKey(h, ObjectKind.KV, salt) for h in self.names]
        return kv + [StorageKey(h, ObjectKind.MAMBA, salt) for h in self.names]

    def longest(
        self, res: TaskResult, missing: Callable[[ObjectKind, bytes], bool]
    ) -> tuple[int, bytes] | None:
        """(length, name) of the longest tail whose page and state storage both hold."""
        n = len(self.names)
        if res.error is not None or len(res.ok) != 2 * n:
            return None
        for i in range(n - 1, -1, -1):
            h = self.names[i]
            if res.ok[i] and res.ok[n + i]:
                if not missing(ObjectKind.KV, h) and not missing(ObjectKind.MAMBA, h):
                    return i + 1, h
        return None


def tail_probe(
    hashes: Sequence[bytes],
    tokens: Sequence[int],
    stored_blocks: int,
    block_size: int,
    limit: int,
    block_states: Sequence[int],
) -> TailProbe | None:
    """The probe for a tail right after the ``stored_blocks`` blocks storage holds, ending at
    most ``limit`` tokens in; None when no tail can fit."""
    k = stored_blocks
    room = min(block_size - 1, limit - k * block_size)
    if k < 1 or room < 1:
        return None
    names = tail_candidates(hashes[k - 1], tokens[k * block_size : k * block_size + room])
    return TailProbe(k, names, bool(block_states))


class PartialTails:
    """Keeps finished requests' tails in the CPU tier and finds the one a lookup continues.

    Owns only the index of tails; the slots, locks and eviction are the tree's."""

    def __init__(
        self, layout: HybridLayout, tree: HybridRadixTree, counters: SchedulerCounters
    ) -> None:
        self.layout = layout
        self.tree = tree
        self.counters = counters
        self.index = TailIndex()
        # The model runner writes a step's new blocks before the tails' copy (Model Runner V2
        # without himamba's step-start hook; the connector sets it): see ``drop_overwritten``.
        self.blocks_written_first = False

    def keep(
        self,
        request: Request,
        block_ids: Sequence[Sequence[int]],
        partition: Hashable,
        lora_tag: str,
        plan: StepPlan,
    ) -> bool:
        """Plan the copy of ``request``'s tail into ``plan`` as an early store (first hook of
        the next step); True if planned."""
        bs = self.layout.block_size
        computed = request.num_computed_tokens
        p, length = divmod(computed, bs)
        if not length or not p or getattr(request, "mm_features", None):
            return False  # on a boundary (a normal hit), or content the tokens do not name
        if computed > request.num_tokens:
            # Async scheduling: a forward in flight takes a token sampled by another forward
            # whose output vLLM has not processed yet. Its state will be past every token
            # this request names, so no length names it.
            self.counters.tails_unnamed += 1
            return False
        hashes = block_hashes(request, self.layout.hashes_per_block)
        if len(hashes) < p:
            return False
        attention = _column(block_ids, self.layout.attention, p)
        mamba = _column(block_ids, self.layout.mamba, p)  # align mode: the running state
        if attention is None or mamba is None:
            return False
        tokens = request.all_token_ids[p * bs : computed]
        tail = tail_hash(hashes[p - 1], tokens)
        path = [*hashes[:p], tail]
        slot = self.tree.reserve_kv(path, partition, p, from_device=True)
        if slot is None:
            return False  # already kept (the same answer again), or no room
        state = self.tree.reserve_mamba(path, partition, p + 1, from_device=True)
        if state is None:
            self.tree.complete_store([slot], [], ok=False)
            return False
        # Early stores lead both batches: only tails add stores before the plan is built.
        assert len(plan.kv_stores) == len(plan.mamba_stores) == plan.early_stores
        plan.kv_stores.add(slot, attention, tail, lora_tag)
        plan.mamba_stores.add(state, mamba, tail, lora_tag)
        plan.early_stores += 1
        self.index.add(partition, hashes[p - 1], tail, length)
        self.counters.tails_stored += 1
        return True

    def drop_overwritten(self, plan: StepPlan, scheduler_output: SchedulerOutput) -> None:
        """Give up the planned tails whose blocks ``scheduler_output`` hands to a request, when
        the runner writes those before the tails' copy (Model Runner V2 without himamba's
        step-start hook zeroes a step's new blocks, applies block copies and moves Mamba
        states into them before the connector's first hook). V1, and V2 with the hook, copy
        first, so a tail is read before its blocks change."""
        if not plan.early_stores or not self.blocks_written_first:
            return
        plan.tails_screened = True
        handed = blocks_handed_out(scheduler_output)
        kv, mamba = plan.kv_stores, plan.mamba_stores
        n = plan.early_stores
        lost = {
            i
            for i in range(n)
            if any(c[i] in handed for c in kv.blocks) or any(c[i] in handed for c in mamba.blocks)
        }
        if not lost:
            return
        self.tree.complete_store(
            [kv.slots[i] for i in sorted(lost)], [mamba.slots[i] for i in sorted(lost)], ok=False
        )
        keep = [i for i in range(len(kv)) if i not in lost]
        plan.kv_stores, plan.mamba_stores = kv.select(keep), mamba.select(keep)
        plan.early_stores = n - len(lost)
        self.counters.tails_overwritten += len(lost)

    def drop_planned(self, plan: StepPlan) -> None:
        """Forget the tails ``plan`` would copy (a reset before it is sent): their bytes are
        from before the reset, and the plan would store them under the new key epoch."""
        if plan.early_stores:
            self.tree.complete_store(plan.kv_stores.slots, plan.mamba_stores.slots, ok=False)
            plan.kv_stores, plan.mamba_stores, plan.early_stores = StoreBatch(), StoreBatch(), 0

    def adopt(
        self,
        probe: TailProbe,
        res: TaskResult,
        hashes: Sequence[bytes],
        partition: Hashable,
        missing: Callable[[ObjectKind, bytes], bool],
    ) -> list[bytes] | None:
        """Fold a tail probe's answer in: the longest tail storage holds whole joins the tree
        (as in storage) and the index. Returns the path through it, for the fetch; None if
        storage holds none."""
        found = probe.longest(res, missing)
        if found is None:
            return None
        k, (length, tail) = probe.parent_blocks, found
        path = [*hashes[:k], tail]
        self.tree.mark_storage(path, partition, k + 1, [k + 1])
        self.index.add(partition, hashes[k - 1], tail, length)
        self.counters.storage_tails_seen += 1
        return path

    def deeper_hit(
        self,
        request: Request,
        hashes: Sequence[bytes],
        partition: Hashable,
        start: int,
        have_blocks: int,
    ) -> tuple[MatchResult, int] | None:
        """A host hit through a tail, deeper than ``have_blocks`` whole blocks: the result
        (its last block the tail) and the tokens it adds past block ``start``."""
        bs = self.layout.block_size
        hit = self.index.best(
            partition,
            hashes,
            request.all_token_ids,
            bs,
            max(start, have_blocks, 1),
            request.num_tokens - 1,
        )
        if hit is None:
            return None
        p = hit.parent_blocks
        result = self.tree.match([*hashes[:p], hit.tail], partition, start, p + 1)
        if result.host_num_blocks != p + 1:
            return None  # evicted (or part of it only in storage)
        return result, (p - start) * bs + hit.length


def blocks_handed_out(so: SchedulerOutput) -> set[int]:
    """Every block id ``so`` gives a request (new requests' tables, blocks appended to running
    or resumed ones), zeroes, or copies into: what a runner may write before its first hook.
    Block ids are the pool's, shared by all groups."""
    handed = set(so.new_block_ids_to_zero or ())
    for new in so.scheduled_new_reqs:
        for ids in new.block_ids:
            handed.update(ids)
    for groups in so.scheduled_cached_reqs.new_block_ids:
        for ids in groups or ():
            handed.update(ids)
    handed.update(copy[1] for copy in so.kv_cache_block_copies or ())  # (src, dst)
    return handed


def _column(
    block_ids: Sequence[Sequence[int]], groups: Sequence[GroupLayout], index: int
) -> list[int] | None:
    """Each group's block at ``index`` of the request's block table (None: one is missing)."""
    out = []
    for g in groups:
        row = block_ids[g.group_id]
        if len(row) <= index or not row[index]:
            return None
        out.append(row[index])
    return out
