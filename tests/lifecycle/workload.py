"""Token sequences and small driving steps shared by the lifecycle tests."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import RequestStatus

from .vllm_setup import VOCAB_SIZE

if TYPE_CHECKING:
    from .engine import LifecycleEngine


def prompt_of(seed: int, length: int, prefix: list[int] | None = None) -> list[int]:
    """``prefix`` followed by pseudo-random tokens (never 0..3, the special ids)."""
    rng = random.Random(seed)
    head = list(prefix or [])
    return head + [rng.randrange(4, VOCAB_SIZE) for _ in range(length - len(head))]


def cache_prefix(
    engine: LifecycleEngine, req_id: str, prompt: list[int], max_tokens: int = 2
) -> None:
    """Serve ``prompt`` once, then drop vLLM's GPU copy: only the connector still has it."""
    engine.add_request(req_id, prompt, max_tokens=max_tokens)
    engine.run_until_idle()
    assert engine.scheduler.reset_prefix_cache(), "vLLM kept GPU blocks in use"


def assert_host_tier_replays(
    engine: LifecycleEngine, req_id: str, prompt: list[int], like: str, host_tokens: int
) -> None:
    """Drop vLLM's own copy, serve ``prompt`` again: it must hit ``host_tokens`` from the CPU
    tier and produce ``like``'s tokens (the runner checks every loaded byte)."""
    assert engine.scheduler.reset_prefix_cache()
    engine.add_request(req_id, prompt, max_tokens=3)
    engine.run_until_idle()
    assert engine.records[req_id].output == engine.records[like].output
    assert engine.hits.host == host_tokens, engine.hits


def waiting_on_connector(engine: LifecycleEngine, req_id: str) -> bool:
    """The connector's last answer for ``req_id`` was 'ask again later' (None)."""
    answers = engine.lookups.get(req_id)
    return bool(answers) and answers[-1][0] is None


def schedule_until_loading(
    engine: LifecycleEngine, req_id: str, max_steps: int = 2000
) -> SchedulerOutput:
    """Step until the scheduler admits ``req_id`` with an async load; return that step's
    SchedulerOutput, not yet executed (the load is planned but no worker has run it)."""
    engine.flush_queue()
    for _ in range(max_steps):
        so = engine.schedule()
        if engine.status(req_id) == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return so
        engine.update(so, engine.execute(so))
        time.sleep(0.001)
    raise AssertionError(f"{req_id} never started a load: {engine.lookups.get(req_id)}")
