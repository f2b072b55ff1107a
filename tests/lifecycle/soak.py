"""Random soak: many short requests over shared prefixes, with every fault kind at once.

Prefixes are drawn from a skewed pool of "documents", so the hottest stay in vLLM's GPU
cache, warm ones live in the CPU tier, and cold ones are only in storage (the CPU tier is
small): hits happen on every tier. Faults: aborts at random moments, failed host->device
loads, failed storage ops, delayed and lost fetch acknowledgements. With a ``churn``
(churn.Churn) storage is also attached, detached and switched between steps, and the caches
are reset (see churn.py).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .engine import LifecycleEngine
from .faults import AckFault
from .workload import prompt_of

if TYPE_CHECKING:
    from .churn import Churn


@dataclass(frozen=True)
class SoakPlan:
    num_requests: int
    seed: int = 0
    live_requests: int = 96
    num_documents: int = 4000
    hot_documents: int = 16
    warm_documents: int = 160
    hot_share: float = 0.3
    warm_share: float = 0.5
    doc_blocks: tuple[int, int] = (2, 5)
    suffix_tokens: tuple[int, int] = (1, 14)
    max_tokens: tuple[int, int] = (1, 3)
    abort_rate: float = 0.02  # per new request: aborted at a random later step
    # Lost acknowledgements: each one keeps a fetch open until the connector reclaims it
    # (seconds), so a fixed number spread over the run, not a rate.
    lost_acks: int = 10
    node_sample_every: int = 200
    # Share of requests with a cache salt (one of ``salts``): same tokens, other bytes.
    salted_share: float = 0.0
    salts: tuple[str, ...] = ("tenant-a", "tenant-b")
    # Share of requests that are a conversation's next turn: a finished request's prompt and
    # answer plus a new message (what partial tails hit through), under the same salt.
    conversation_share: float = 0.0
    conversations_kept: int = 256  # finished requests a next turn may continue
    conversation_max_tokens: int = 320  # longer ones are not continued (max_model_len 512)


@dataclass
class SoakResult:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    errors: int = 0
    steps: int = 0
    seconds: float = 0.0
    max_tree_nodes: int = 0
    next_turns: int = 0  # requests that continued a finished one (conversation_share)
    tree_nodes_end: int = 0
    connector_stats: dict[str, Any] = field(default_factory=dict)


def _document(rng: random.Random, plan: SoakPlan) -> int:
    """Hot documents stay in vLLM's GPU cache, the warm set is larger than the GPU cache and
    the CPU tier together (so it is served from both and from storage), the cold tail
    mostly misses and feeds storage."""
    r = rng.random()
    if r < plan.hot_share:
        return rng.randrange(plan.hot_documents)
    if r < plan.hot_share + plan.warm_share:
        return plan.hot_documents + rng.randrange(plan.warm_documents)
    return rng.randrange(plan.num_documents)


@dataclass
class Conversations:
    """Finished (or aborted) requests a next turn may continue: (prompt + answer, cache salt)."""

    plan: SoakPlan
    turns: deque[tuple[list[int], str | None]] = field(init=False)
    continued: int = 0

    def __post_init__(self) -> None:
        self.turns = deque(maxlen=self.plan.conversations_kept)

    def finished(self, engine: LifecycleEngine, rid: str) -> None:
        # Aborted requests too: a user continues after a cancelled answer, and under async
        # scheduling an aborted request's tail covers a forward still in flight.
        rec = engine.records[rid]
        if getattr(rec.finish, "name", None) not in ("LENGTH", "STOP", "ABORT"):
            return
        tokens = rec.prompt + rec.output
        if len(tokens) > self.plan.conversation_max_tokens:
            return
        self.turns.append((tokens, rec.cache_salt))

    def next_turn(self, rng: random.Random) -> tuple[list[int], str | None] | None:
        if not self.plan.conversation_share or not self.turns:
            return None
        if rng.random() >= self.plan.conversation_share:
            return None
        self.continued += 1
        tokens, salt = self.turns[rng.randrange(len(self.turns))]
        return list(tokens), salt


def tree_nodes(engine: LifecycleEngine) -> int:
    return int(engine.connector.stats().get("nodes", 0))


def run_soak(
    engine: LifecycleEngine,
    plan: SoakPlan,
    lost_acks: AckFault | None = None,
    churn: Churn | None = None,
) -> SoakResult:
    rng = random.Random(plan.seed)
    bs = engine.kv.block_size
    docs: dict[int, list[int]] = {}
    result = SoakResult()
    abort_at: dict[int, list[str]] = {}
    live: set[str] = set()
    next_id = 0
    talks = Conversations(plan)
    arm_every = max(1, plan.num_requests // (plan.lost_acks + 1))
    start = time.monotonic()
    while next_id < plan.num_requests or live:
        while (
            next_id < plan.num_requests
            and len(live) < plan.live_requests
            and (churn is None or churn.may_admit())
        ):
            turn = talks.next_turn(rng)
            if turn is None:
                d = _document(rng, plan)
                if d not in docs:
                    docs[d] = prompt_of(10_000 + d, rng.randint(*plan.doc_blocks) * bs)
                head, salt = docs[d], None
            else:
                head, salt = turn
            prompt = head + prompt_of(rng.randrange(1 << 30), rng.randint(*plan.suffix_tokens))
            if turn is None and plan.salted_share and rng.random() < plan.salted_share:
                salt = rng.choice(plan.salts)
            if lost_acks is not None and next_id and next_id % arm_every == 0:
                lost_acks.arm(1)
            rid = f"s{next_id}"
            engine.add_request(
                rid, prompt, max_tokens=rng.randint(*plan.max_tokens), cache_salt=salt
            )
            live.add(rid)
            if rng.random() < plan.abort_rate:
                abort_at.setdefault(engine.steps + rng.randint(0, 6), []).append(rid)
            next_id += 1
        engine.step()
        for rid in abort_at.pop(engine.steps, ()):
            if rid in live and engine.records[rid].finish is None:
                engine.abort([rid])
        for rid in [r for r in live if engine.records[r].finish is not None]:
            live.discard(rid)
            talks.finished(engine, rid)
        if churn is not None:
            churn.after_step(live)
        if engine.steps % plan.node_sample_every == 0:
            result.max_tree_nodes = max(result.max_tree_nodes, tree_nodes(engine))
    engine.run_until_idle()
    result.seconds = time.monotonic() - start
    result.requests = next_id
    result.steps = engine.steps
    for rec in engine.records.values():
        reason = getattr(rec.finish, "name", None)
        result.finished += reason in ("LENGTH", "STOP")
        result.aborted += reason == "ABORT"
        result.errors += reason == "ERROR"
    result.next_turns = talks.continued
    result.tree_nodes_end = tree_nodes(engine)
    result.max_tree_nodes = max(result.max_tree_nodes, result.tree_nodes_end)
    result.connector_stats = dict(engine.connector.stats())
    return result


def ack_faults(seed: int, keep_control: bool = False) -> tuple[AckFault, AckFault]:
    """(late, lost) acknowledgements on rank 0: 10% of metadata arrive 2 steps late; the lost
    one drops the next metadata each time ``run_soak`` arms it (``keep_control``: only its
    fetch acknowledgements, storage switches still arrive)."""
    return (
        AckFault(rank=0, delay_steps=2, rate=0.1, seed=seed),
        AckFault(rank=0, drop=True, remaining=0, keep_control=keep_control),
    )
