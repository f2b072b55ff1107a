"""StoreDue must name every scheduled request that fills its next block, in the step it does
(a block noticed late may already be gone from the device), across chunked prefill, decode,
multi-token steps, preemption (computed tokens fall back), unscheduled and finished requests.

The scheduler output is a plain record with the fields vLLM's ``SchedulerOutput`` gives the
connector: this checks the bound itself against a full scan, step by step, on random
schedules far more varied than a real engine produces in a test's time (the lifecycle tests
cover StoreDue inside a real vLLM scheduler)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

import himamba.connector.scheduler.store_due as mod
from himamba.connector.scheduler.store_due import NEVER, StoreDue

BS = 16


class _Req:
    def __init__(self, req_id: str, prompt: int, tracked: bool) -> None:
        self.req_id, self.prompt, self.tracked = req_id, prompt, tracked
        self.computed = 0
        self.seen = False  # scheduled once: later steps list it among the cached requests
        self.paused = 0  # steps left unscheduled (preempted)


def _output(sched: list[tuple[_Req, int]]) -> SimpleNamespace:
    new = [r for r, _ in sched if not r.seen]
    cached = [r for r, _ in sched if r.seen]
    return SimpleNamespace(
        num_scheduled_tokens={r.req_id: n for r, n in sched},
        total_num_scheduled_tokens=sum(n for _, n in sched),
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r.req_id, num_computed_tokens=r.computed) for r in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r.req_id for r in cached], num_computed_tokens=[r.computed for r in cached]
        ),
    )


def _next_at(done: int, cap: int | None) -> int:
    block = done // BS
    return NEVER if cap is not None and block >= cap else (block + 1) * BS


@pytest.mark.parametrize("seed", range(12))
def test_every_block_filled_in_a_step_is_named_in_that_step(seed: int) -> None:
    rng = random.Random(seed)
    due = StoreDue()
    live: list[_Req] = []
    at: dict[str, int] = {}  # the caller's view, as HostStores keeps it
    caps: dict[str, int | None] = {}
    named = 0
    for step in range(400):
        if len(live) < 40 and rng.random() < 0.3:
            r = _Req(f"r{step}", rng.randint(1, 300), tracked=rng.random() < 0.9)
            live.append(r)
            if r.tracked:
                caps[r.req_id] = None if rng.random() < 0.5 else r.prompt // BS
                at[r.req_id] = _next_at(0, caps[r.req_id])
                due.watch(r.req_id, r.prompt)
                due.set(r.req_id, at[r.req_id], None)
        sched: list[tuple[_Req, int]] = []
        budget = rng.choice([64, 256, 2048])
        for r in live:
            if r.paused:
                r.paused -= 1
                continue
            if r.seen and rng.random() < 0.02:  # preempted: recomputed from scratch later
                r.computed, r.paused = 0, rng.randint(1, 5)
                continue
            if rng.random() < 0.1 or budget <= 0:
                continue  # not scheduled this step
            if r.computed < r.prompt:
                n = min(rng.randint(1, 200), r.prompt - r.computed, budget)
            else:
                n = rng.choice([1, 1, 1, 1, 2, 4])  # decode, sometimes speculative
            budget -= n
            sched.append((r, n))
        so = _output(sched)
        expected = {
            r.req_id: r.computed + n
            for r, n in sched
            if r.tracked and r.computed + n >= at[r.req_id]
        }
        got = dict(due.step(so))
        assert got == expected, f"step {step}"
        named += len(got)
        for req_id, done in got.items():
            if rng.random() < 0.8:  # stored: the next block; else the same one again later
                at[req_id] = _next_at(done, caps[req_id])
                due.set(req_id, at[req_id], done)
        for r, n in sched:
            r.computed += n
            r.seen = True
        for r in list(live):
            if r.computed >= r.prompt + 120 or rng.random() < 0.01:
                live.remove(r)
                due.forget(r.req_id)
    assert named > 50  # the schedules did fill blocks


def test_a_decoding_request_is_read_about_once_per_block() -> None:
    """256 requests decoding one token a step: a few reads per step, not 256."""
    due = StoreDue()
    reqs = [_Req(f"r{i}", 100 + i, tracked=True) for i in range(256)]
    for r in reqs:
        r.computed, r.seen = r.prompt, True
        due.watch(r.req_id, r.prompt)
        due.set(r.req_id, _next_at(r.computed, None), None)
    reads = 0
    real_get = mod._Before.get

    def counting_get(self: object, req_id: str) -> int | None:
        nonlocal reads
        reads += 1
        return real_get(self, req_id)  # type: ignore[arg-type]

    mod._Before.get = counting_get  # type: ignore[method-assign]
    try:
        for _ in range(3 * BS):
            so = _output([(r, 1) for r in reqs])
            for req_id, done in due.step(so):
                due.set(req_id, _next_at(done, None), done)
            for r in reqs:
                r.computed += 1
    finally:
        mod._Before.get = real_get  # type: ignore[method-assign]
    steps = 3 * BS
    # The first steps read everyone (their position was unknown: set with done=None, and
    # the prompt is done), then each request once per block.
    assert reads <= 2 * 256 + steps * (256 // BS + 2)
    assert reads < steps * 256 / 4
