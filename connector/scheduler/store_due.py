"""Which scheduled requests may have filled their next block this step, found without reading
every running request every step.

A step that gives each of its ``M`` scheduled requests at least one token, ``T`` tokens in
all, advances none of them by more than ``T - (M - 1)``. The few requests read exactly each
step (new ones and those still in their prompt) are left out of ``M`` and ``T``; in steady
decode the bound is then one token. Summed over steps it is a clock: a request ``k`` tokens
short of its next full block when the clock read ``c`` cannot fill that block before the
clock reaches ``c + k``. A heap keyed by that time yields the requests worth reading; a
decoding request is read about once per block rather than once per step (at 256 running
requests the per-step scan was the largest fixed cost of planning stores).

The bound never undercounts, so a full block is never noticed late (its device block could
be gone by then); at worst a request is read early and queued again.
"""

from __future__ import annotations

import heapq
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

NEVER = sys.maxsize


class StoreDue:
    """Per request: the computed-token count at which its next block is full (``at``)."""

    def __init__(self) -> None:
        self.at: dict[str, int] = {}
        self._clock = 0
        self._heap: list[tuple[int, str]] = []
        self._due: dict[str, int] = {}  # the live heap entry's time per request
        self._prompt_end: dict[str, int] = {}  # requests still in their prompt: read exactly
        # Named by the last step and not ``set`` since: read again this step. Armed only at
        # the next step, so the usual ``set`` that follows a name costs no heap entry.
        self._unset: dict[str, int] = {}

    def watch(self, req_id: str, prompt_tokens: int) -> None:
        """A request starts: it is read exactly until its prompt is computed."""
        self._prompt_end[req_id] = prompt_tokens

    def set(self, req_id: str, at: int, done: int | None) -> None:
        """Its next block is full at ``at`` computed tokens; ``done`` is its count at the end
        of this step (None: unknown, read it at the next step)."""
        self.at[req_id] = at
        self._unset.pop(req_id, None)
        if at == NEVER or req_id in self._prompt_end:
            # Still in its prompt: read exactly whenever scheduled, and armed by the step
            # that reads it past its prompt end (``step``), so no heap entry until then.
            self._due.pop(req_id, None)
            return
        self._arm(req_id, self._clock + (0 if done is None else max(at - done, 0)))

    def forget(self, req_id: str) -> None:
        self.at.pop(req_id, None)
        self._due.pop(req_id, None)
        self._prompt_end.pop(req_id, None)
        self._unset.pop(req_id, None)

    def _arm(self, req_id: str, due: int) -> None:
        self._due[req_id] = due
        heapq.heappush(self._heap, (due, req_id))
        if len(self._heap) > 4 * len(self._due) + 64:
            self._heap = [(d, r) for r, d in self._due.items()]
            heapq.heapify(self._heap)

    def step(self, so: SchedulerOutput) -> list[tuple[str, int]]:
        """(request, computed tokens at this step's end) of the scheduled requests that reach
        their ``at`` this step. Each stays queued to be read again next step; ``set`` with
        its new ``at`` replaces that."""
        if self._unset:
            for req_id, when in self._unset.items():
                self._arm(req_id, when)
            self._unset.clear()
        scheduled = so.num_scheduled_tokens
        at = self.at
        out: list[tuple[str, int]] = []
        exact_tokens = 0
        exact: dict[str, int] = {}  # request -> done, read exactly this step
        for r in so.scheduled_new_reqs:
            n = scheduled.get(r.req_id, 0)
            if n and r.req_id in at:
                exact_tokens += n
                exact[r.req_id] = r.num_computed_tokens + n
        cached = so.scheduled_cached_reqs
        before = _Before(cached.req_ids, cached.num_computed_tokens)
        for req_id in list(self._prompt_end):
            n = scheduled.get(req_id, 0)
            if not n or req_id in exact:
                continue
            b = before.get(req_id)
            if b is not None:
                exact_tokens += n
                exact[req_id] = b + n
        others = len(scheduled) - len(exact)
        rest = so.total_num_scheduled_tokens - exact_tokens
        bound = 1
        if others:
            # Every scheduled request has at least one token (vLLM never schedules zero); if
            # that ever failed, fall back to the loose bound rather than miss a block.
            bound = max(rest - (others - 1), 1) if min(scheduled.values()) >= 1 else max(rest, 1)
        self._clock += bound
        clock, heap, due = self._clock, self._heap, self._due
        idle: list[tuple[str, int]] = []
        while heap and heap[0][0] <= clock:
            when, req_id = heapq.heappop(heap)
            if due.get(req_id) != when or req_id in exact:
                continue
            n = scheduled.get(req_id, 0)
            b = before.get(req_id) if n else None
            if b is None:
                idle.append((req_id, when))
                continue
            exact[req_id] = b + n
        for req_id, when in idle:
            # Not scheduled (or not in the cached list): it advanced nothing this step.
            self._arm(req_id, when + bound)
        prompt_end, unset = self._prompt_end, self._unset
        for req_id, done in exact.items():
            end = prompt_end.get(req_id)
            in_prompt = end is not None and done < end
            if end is not None and not in_prompt:
                del prompt_end[req_id]
            target = at.get(req_id, NEVER)
            if done >= target:
                out.append((req_id, done))
                unset[req_id] = clock  # read again next step unless ``set`` moves it
            elif target != NEVER and not in_prompt:  # (in its prompt: read exactly)
                self._arm(req_id, clock + target - done)
        return out


class _Before:
    """Computed tokens before this step of a few cached requests: a scan of the list per
    request while few are asked for, one dict once more are."""

    __slots__ = ("_ids", "_nums", "_map", "_asked")

    def __init__(self, ids: list[str], nums: list[int]) -> None:
        self._ids, self._nums = ids, nums
        self._map: dict[str, int] | None = None
        self._asked = 0

    def get(self, req_id: str) -> int | None:
        if self._map is None:
            self._asked += 1
            if self._asked <= 4:
                try:
                    return self._nums[self._ids.index(req_id)]
                except ValueError:
                    return None
            self._map = dict(zip(self._ids, self._nums, strict=True))
        return self._map.get(req_id)
