"""Scheduler-side storage policy: probe storage for a request, then prefetch storage -> CPU.

Each request moves one way through PROBING -> FETCHING -> SETTLED (or straight to SETTLED), with
one deadline fixed when it is first seen, so it can never wait for storage more than once or
longer than its policy allows:

- PROBING: an ``exists`` over the request's block keys, submitted as early as vLLM lets us
  (``on_new_request``) and skipped when the host tier already covers the prompt. A storage hit
  always starts with block 0's KV object, so that one key goes first: a prompt storage has never
  seen (most of a cold burst) costs one key, not two per block; a yes sends the rest. The lookup waits a
  few milliseconds for the answer (a bounded budget per engine step), so a cold request normally
  costs no extra engine step. Answers are folded into the tree as they arrive, at every step,
  whether or not the request is looked up again, in one walk of its path.
- ANSWERED: storage has part of the prompt, but vLLM has not said yet how much of it its own
  device cache holds (the request was not looked up): the fetch waits for that lookup, so it
  never reads blocks the device already has.
- FETCHING: host slots are reserved for the storage-only part of the deepest hit that fits,
  beyond vLLM's device hit, with the request's path pinned so the reservation cannot evict the
  prefix being fetched (``storage_fetches``). Bytes move storage -> host on the workers; the hit
  becomes an ordinary host hit.
- SETTLED: the request takes whatever the host tier has.

``best_effort`` never waits; its probes and fetches still run (from block 0, since nobody
waits for a lookup) and warm the host tier for later requests. Only storage's own slowness
counts against it: a probe still unanswered by the store at the request's deadline tells the
store (``report_slow``), so storage that is alive but too slow opens the breaker. A deadline
passed while engine steps were slow (a fetch waits for the next plan and its acknowledgement
for the step after) is not the storage's fault and is not reported.

A fetched object that some rank could not read (its shard is missing there: a skipped or
evicted write) is remembered as missing for this generation, so later probes do not send every
request with that prefix into the same failing fetch; a later write of the object clears it
(``missing_objects``).
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from himamba.connector.protocol import FetchAck, FetchOrder, ObjectKind, key_salt
from himamba.connector.scheduler.counters import SchedulerCounters
from himamba.connector.scheduler.generations import StorageGenerations
from himamba.connector.scheduler.missing_objects import MissingObjects
from himamba.connector.scheduler.storage_fetches import Settled, StorageFetches
from himamba.connector.scheduler.tails import PartialTails, TailProbe, tail_probe
from himamba.connector.tree import HybridRadixTree
from himamba.tiers.byte_store import ByteStore
from himamba.tiers.object_format import StorageKey
from himamba.tiers.storage_config import StorageConfig, prefetch_deadline_s
from himamba.tiers.storage_records import TaskResult

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    PROBING = "probing"
    ANSWERED = "answered"
    FETCHING = "fetching"
    SETTLED = "settled"


# How long an empty engine step may wait for storage I/O (see ``idle_wait``). An engine whose
# only requests wait on storage otherwise spins empty steps (scheduler, RPC to every worker)
# as fast as it can, taking the CPU and the GIL from the very threads that answer probes and
# fetches. A probe's answer is waited for up to IDLE_PROBE_WAIT_S (the wait ends the moment it
# comes): with 2 ms, replicas of a fleet on a 2-core box took 150-450 ms for some 22-key
# probes that the store answers in ~5 ms when left alone (bench_fleet, 4 runs each, 96
# requests at turns >= 2: median TTFT 0.148 s with 2 ms, 0.117 s with 20 ms; p90 0.50 / 0.41 s).
# The cost: a request arriving at an engine that is idle but for such probes may wait that
# long to be scheduled. Fetches are acknowledged in a later step's output, not here, so while
# only fetches are in flight a step sleeps IDLE_WAIT_S.
IDLE_WAIT_S = 0.002
IDLE_PROBE_WAIT_S = 0.02


@dataclass
class _Request:
    hashes: list[bytes]
    partition: Hashable
    deadline: float  # monotonic; fixed when the request is first seen
    waits: bool  # False for best_effort, and once a wait timed out
    lora_tag: str = ""  # its adapter's weights (protocol.key_salt)
    phase: Phase = Phase.PROBING
    probe_task: int | None = None
    # The probe in flight asks for block 0's KV object only (see ``_probe_rest``).
    head_only: bool = False
    fetch_id: int | None = None
    # vLLM's device hit in blocks once the request was looked up (None: not yet).
    start_block: int | None = None
    # Blocks fetched from storage for this request (hit-source metrics count those it used).
    fetched_blocks: frozenset[int] = frozenset()
    # Its tokens and the last one a hit may reach, while partial tails are probed for.
    tokens: Sequence[int] | None = None
    limit: int = 0
    # The tail probe in flight (after the block probe's answer), if any.
    tail: TailProbe | None = None


class StoragePlanner:
    def __init__(
        self,
        cfg: StorageConfig,
        store: ByteStore,
        tree: HybridRadixTree,
        counters: SchedulerCounters,
        generations: StorageGenerations,
        world_size: int = 1,
        block_size: int = 1,
        tails: PartialTails | None = None,
    ) -> None:
        self.cfg = cfg
        self.block_size = block_size
        # Partial tails (``scheduler.tails``): probed for past the stored blocks, fetched
        # like a block and its state.
        self.tails = tails
        # Blocks a storage hit must add to be probed and fetched (prefetch_threshold_tokens).
        self.min_gain_blocks = max(1, -(-cfg.prefetch_threshold_tokens // block_size))
        self.store = store
        self.tree = tree
        self.counters = counters
        self.generations = generations
        self.planner = generations.new_planner()
        self.storage_id = cfg.identity()
        self._requests: dict[str, _Request] = {}
        self._probe_owner: dict[int, str] = {}
        self._probe_wait_s = cfg.probe_wait_ms / 1000
        self._wait_budget = self._probe_wait_s
        self._missing = MissingObjects()  # masked out of probe answers
        self.fetches = StorageFetches(
            tree,
            counters,
            generations,
            self.planner,
            world_size,
            cfg.op_deadline_s,
            self.min_gain_blocks,
            self._missing,
            self._fetch_settled,
        )
        # Moves whenever the planner may have changed the tree (storage marks from a probe
        # answer, a fetch reserved or settled): a lookup matches again only if it moved.
        self.tree_changes = 0

    @property
    def epoch(self) -> str:
        """Storage keys carry the generation's epoch: a reset (new weights) makes every older
        object unreachable, here and in another process that reset too."""
        return self.generations.epoch

    # -- request life cycle ------------------------------------------------------------
    def begin(
        self,
        req_id: str,
        hashes: list[bytes],
        partition: Hashable,
        num_tokens: int,
        lora_tag: str = "",
        tokens: Sequence[int] | None = None,
    ) -> None:
        """Start the request's probe now (idempotent). ``tokens``: the request's, when a
        partial tail past its stored blocks is worth looking for."""
        if req_id in self._requests or not hashes:
            return
        wait = prefetch_deadline_s(self.cfg, num_tokens)
        deadline = time.monotonic() + (wait if math.isfinite(wait) else 3600.0)
        st = _Request(list(hashes), partition, deadline, waits=wait > 0, lora_tag=lora_tag)
        if self.tails is not None:
            st.tokens, st.limit = tokens, num_tokens - 1
        self._requests[req_id] = st
        if len(hashes) == 1:
            self._probe_rest(req_id, st)
            return
        st.head_only = True
        head = StorageKey(hashes[0], ObjectKind.KV, key_salt(self.epoch, lora_tag))
        self._submit_probe(req_id, st, [head])

    def _probe_rest(self, req_id: str, st: _Request) -> None:
        """Probe every block's KV object and state: the answer says how deep a hit goes and
        where it may end."""
        st.head_only = False
        salt = key_salt(self.epoch, st.lora_tag)
        keys = [StorageKey(h, ObjectKind.KV, salt) for h in st.hashes]
        keys += [StorageKey(h, ObjectKind.MAMBA, salt) for h in st.hashes]
        self._submit_probe(req_id, st, keys)

    def _submit_probe(self, req_id: str, st: _Request, keys: list[StorageKey]) -> None:
        st.probe_task = self.store.submit_exists(keys)
        self._probe_owner[st.probe_task] = req_id
        self.counters.storage_probes += 1

    def worth_probing(self, have_blocks: int, max_blocks: int) -> bool:
        """Could storage add enough to a request that already has ``have_blocks``?"""
        return max_blocks - have_blocks >= self.min_gain_blocks

    def known(self, req_id: str) -> bool:
        return req_id in self._requests

    def still_probing(self, req_id: str) -> bool:
        """The request waits for its probe, which is still in flight, and this step's wait
        budget is spent: it will be asked again next step, so a lookup can answer before any
        other work. vLLM asks every waiting request each step, so during an arrival burst
        this is most lookups."""
        st = self._requests.get(req_id)
        if st is None or st.phase is not Phase.PROBING or not st.waits or self._wait_budget > 0:
            return False
        self._drain()
        return st.phase is Phase.PROBING and time.monotonic() < st.deadline

    def must_wait(self, req_id: str, start_block: int, max_blocks: int) -> bool:
        """True while the request should be asked again later (vLLM's ``None`` answer)."""
        st = self._requests.get(req_id)
        if st is None:
            return False
        st.start_block = start_block
        if st.phase is Phase.PROBING:
            self._drain()  # others' answers wait for the step's drain
        if st.phase is Phase.PROBING and st.waits and self._wait_budget > 0:
            self._wait_for_probe(st)
        if st.phase is Phase.ANSWERED:
            st.phase = Phase.FETCHING if self._start_fetch(req_id, st) else Phase.SETTLED
        if st.phase is Phase.SETTLED or not st.waits:
            return False
        if time.monotonic() < st.deadline:
            return True
        self.counters[f"storage_{st.phase.value}_timeouts"] += 1
        if st.phase is Phase.PROBING:
            # The store itself has not answered in the request's whole budget (_drain just
            # polled it): storage is slow, not the engine's steps.
            self.store.report_slow("a storage probe outlived its request's prefetch deadline")
        st.waits = False  # the work goes on in the background; this request goes ahead
        if st.fetch_id is not None:
            self.fetches.untie(st.fetch_id)
        return False

    def _wait_for_probe(self, st: _Request) -> None:
        """Within this step's budget, until the probe is answered (both of its rounds)."""
        while st.phase is Phase.PROBING and self._wait_budget > 0:
            assert st.probe_task is not None
            started = time.monotonic()
            res = self.store.wait(st.probe_task, self._wait_budget)
            self._wait_budget -= time.monotonic() - started
            if res is None:
                return
            self._on_probe_answer(res)

    def forget(self, req_id: str) -> None:
        """The request finished (or was aborted): its pending fetch is of no use to anyone
        waiting, so it is cancelled now rather than left holding slots."""
        st = self._requests.pop(req_id, None)
        if st is None:
            return
        if st.probe_task is not None:
            self._probe_owner.pop(st.probe_task, None)
        if st.fetch_id is not None:
            self.fetches.drop_if_tied(st.fetch_id)

    def storage_blocks_used(self, req_id: str, start: int, end: int) -> int:
        """How many blocks of a hit on ``[start, end)`` this request's fetch brought in."""
        st = self._requests.get(req_id)
        if st is None or not st.fetched_blocks:
            return 0
        return sum(start <= i < end for i in st.fetched_blocks)

    # -- per step ----------------------------------------------------------------------
    def step(self) -> tuple[list[FetchOrder], list[int]]:
        """Once per engine step: fold in answers, reclaim overdue fetches, hand out the outbox."""
        self._wait_budget = self._probe_wait_s
        self._drain()
        return self.fetches.step(time.monotonic())

    def idle_wait(self) -> None:
        """The engine scheduled nothing this step: wait up to ``IDLE_PROBE_WAIT_S`` for the
        oldest probe's answer, or sleep ``IDLE_WAIT_S`` while fetches are in flight (their acks
        come from the workers with a later step). No request runs that the wait could delay;
        one that arrives meanwhile waits for it."""
        if self._probe_owner:
            res = self.store.wait(next(iter(self._probe_owner)), IDLE_PROBE_WAIT_S)
            if res is not None:
                self._on_probe_answer(res)
        elif len(self.fetches):
            time.sleep(IDLE_WAIT_S)

    def on_acks(self, acks: Sequence[FetchAck]) -> None:
        self.fetches.on_acks(acks)

    def has_work(self) -> bool:
        """Fetches in flight need engine steps to be acknowledged (vLLM: has_pending_push_work)."""
        return len(self.fetches) > 0

    def reset(self) -> None:
        """The epoch moved (``StorageGenerations.new_epoch``): every fetch and probe in flight
        is of the old one; abandon them and let every request take what the host has."""
        self.fetches.abandon_all()
        self._probe_owner.clear()
        self._missing.clear()
        for st in self._requests.values():
            st.phase, st.waits, st.probe_task, st.fetch_id = Phase.SETTLED, False, None, None

    def close(self) -> list[int]:
        """Detached: abandon every fetch (slots return at once); returns the fetch ids the
        workers must still be told to cancel (the caller sends them with the next plan)."""
        self.fetches.abandon_all()
        cancels = self.fetches.take_cancels()
        self._probe_owner.clear()
        self._requests.clear()
        return cancels

    def has_missing(self) -> bool:
        return bool(self._missing)

    def wrote(self, kind: ObjectKind, block_hash: bytes) -> None:
        """The object is being written again (every rank): it may be whole now."""
        self._missing.forget(kind, block_hash)

    # -- probe answers ---------------------------------------------------------------------
    def _drain(self) -> None:
        # A head answer may send the rest of its probe: poll once more for stores that answer
        # at once (the rest of a real store's answers come with a later step).
        for _ in range(2):
            sent_rest = False
            for res in self.store.poll():
                sent_rest |= self._on_probe_answer(res)
            if not sent_rest:
                return

    def _on_probe_answer(self, res: TaskResult) -> bool:
        """Fold one probe answer in; True if it was a head answer that sent the rest."""
        req_id = self._probe_owner.pop(res.task_id, None)
        st = None if req_id is None else self._requests.get(req_id)
        if st is None or st.probe_task != res.task_id:
            return False  # the request is gone, or the answer predates a reset
        st.probe_task = None
        st.phase = Phase.SETTLED
        if st.head_only:
            return self._on_head_answer(req_id, st, res)
        if st.tail is not None:
            return self._on_tail_answer(req_id, st, res)
        n = len(st.hashes)
        if res.error is not None or len(res.ok) != 2 * n:
            return False
        kv_ok, mamba_ok = list(res.ok[:n]), list(res.ok[n:])
        if self._missing:
            masked = self._missing.mask(st.hashes, kv_ok, mamba_ok, self.epoch)
            self.counters.storage_missing_masked += masked
        prefix = 0
        while prefix < n and kv_ok[prefix]:
            prefix += 1
        if not prefix:
            return False
        ends = [b for b in range(1, prefix + 1) if mamba_ok[b - 1]]
        self.tree_changes += 1
        self.tree.mark_storage(st.hashes, st.partition, prefix, ends)
        self.counters.storage_blocks_seen += prefix
        if st.tokens is not None:
            st.tail = tail_probe(st.hashes, st.tokens, prefix, self.block_size, st.limit, ends)
            if st.tail is not None:  # one more round: the tail past the stored blocks
                st.phase = Phase.PROBING
                salt = key_salt(self.epoch, st.lora_tag)
                self._submit_probe(req_id, st, st.tail.keys(salt))
                return True
        if not ends:
            return False
        self._answered(req_id, st)
        return False

    def _on_tail_answer(self, req_id: str, st: _Request, res: TaskResult) -> bool:
        """The tail probe's answer: the longest tail storage holds whole (KV page and state)
        joins the tree, and the request's fetch goes down its path."""
        probe, st.tail = st.tail, None
        assert probe is not None and self.tails is not None
        missing = lambda kind, h: self._missing.has(kind, h, self.epoch)  # noqa: E731
        path = self.tails.adopt(probe, res, st.hashes, st.partition, missing)
        if path is not None:
            self.tree_changes += 1
            st.hashes = path
        elif not probe.block_states:
            return False
        self._answered(req_id, st)
        return False

    def _answered(self, req_id: str, st: _Request) -> None:
        """Storage holds a hit for the request: fetch it now, or at its lookup."""
        if st.start_block is None and st.waits:
            st.phase = Phase.ANSWERED  # the fetch starts at the lookup, past the device hit
        elif self._start_fetch(req_id, st):
            st.phase = Phase.FETCHING

    def _on_head_answer(self, req_id: str, st: _Request, res: TaskResult) -> bool:
        """Block 0's KV object: without it storage holds no hit for this prompt (the request
        settles, as a full probe's answer would have it); with it, probe the rest (True)."""
        if res.error is not None or tuple(res.ok) != (True,):
            self.counters.storage_probes_head_missed += 1
            return False
        if self._missing.has(ObjectKind.KV, st.hashes[0], self.epoch):
            self.counters.storage_missing_masked += 1
            return False
        st.phase = Phase.PROBING
        self._probe_rest(req_id, st)
        return True

    # -- fetches -------------------------------------------------------------------------
    def _start_fetch(self, req_id: str, st: _Request) -> bool:
        """Fetch the storage-only part of the request's deepest hit that fits (``fetches``)."""
        self.tree_changes += 1
        fid = self.fetches.start(
            req_id, st.hashes, st.partition, st.start_block or 0, st.waits, st.lora_tag
        )
        st.fetch_id = fid
        return fid is not None

    def _fetch_settled(self, done: Settled) -> None:
        self.tree_changes += 1
        st = self._requests.get(done.req_id)
        if st is not None and st.fetch_id == done.fetch_id:
            st.fetch_id = None
            st.phase = Phase.SETTLED
            if done.fetched_blocks is not None:
                st.fetched_blocks = done.fetched_blocks

    # -- introspection ---------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Probes and fetches in flight, and the fetch ledger's counters (``fetch_*``)."""
        ledger = self.fetches.ledger_counters.as_dict()
        return {
            "storage_probes_pending": len(self._probe_owner),
            "storage_fetches_pending": len(self.fetches),
            **{f"fetch_{k}": v for k, v in ledger.items()},
        }

    def leak_report(self) -> dict[str, int]:
        return {
            "storage_requests": len(self._requests),
            "storage_probes_pending": len(self._probe_owner),
            "storage_fetches_open": len(self.fetches),
            "storage_fetch_slots_held": self.fetches.held_slots(),
        }
