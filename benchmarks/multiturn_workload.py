"""The multi-turn conversation workload, driven through ``/v1/completions`` with token ids.

N conversations share one system prompt; each has R turns. Turn t's prompt is exactly turn
t-1's prompt + the tokens the server generated for it + new user tokens, built from the token
ids the server returned (``return_token_ids``), so no detokenize/retokenize round trip can
change the prefix. M client threads own the conversations round-robin (conversation c belongs
to thread c mod M) and all threads finish turn t before any starts turn t+1, so between two
turns of one conversation every other conversation has had its turn: the device cache, sized
below the whole working set, has had the chance to drop it. That barrier is also where the
server's prefix-cache counters are read, so each turn index gets its own local/external split.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import requests

from benchmarks.multiturn_server import SERVED_NAME, PrefixCounters, Server

# Token ids drawn for prompts: clear of the tiny vocabulary's specials (pad, bos, eos, unk).
TOKEN_LOW, TOKEN_HIGH = 3, 1000


@dataclass(frozen=True)
class Workload:
    """Sizes of the conversations; the same for every configuration of a run."""

    conversations: int
    turns: int
    clients: int
    system_tokens: int  # shared by every conversation
    first_user_tokens: int  # turn 1's user message (say, a pasted document)
    user_tokens: int  # every later turn's user message
    output_tokens: int
    seed: int = 0

    def final_prompt_tokens(self) -> int:
        """Prompt length of the last turn (every earlier output is in it)."""
        later = (self.turns - 1) * (self.user_tokens + self.output_tokens)
        return self.system_tokens + self.first_user_tokens + later

    def system_prompt(self) -> list[int]:
        return _tokens(("system", self.seed), self.system_tokens)

    def user_message(self, conversation: int, turn: int) -> list[int]:
        n = self.first_user_tokens if turn == 1 else self.user_tokens
        return _tokens(("user", self.seed, conversation, turn), n)

    def owner(self, conversation: int) -> int:
        return conversation % self.clients


def _tokens(key: tuple[Any, ...], n: int) -> list[int]:
    r = random.Random(json.dumps(key))
    return [r.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


@dataclass
class TurnRecord:
    """One request: what a user of this conversation saw, and what the server says it reused."""

    config: str
    repeat: int
    conversation: int
    turn: int  # 1-based
    client: int
    prompt_tokens: int
    output_token_ids: list[int]
    ttft_s: float  # first streamed token, measured by the client
    e2e_s: float
    start_s: float  # since the configuration's first request
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens (device + connector)
    server_ttft_ms: float | None
    server_queue_ms: float | None
    prompt_echo_matches: bool  # the server's prompt_token_ids equal what was sent

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunResult:
    """Every turn of one configuration, the counters at each turn barrier, and the wall time."""

    records: list[TurnRecord]
    counters: list[PrefixCounters]  # [before turn 1, after turn 1, ..., after turn R]
    wall_s: float
    errors: list[str] = field(default_factory=list)

    def round_counters(self, turn: int) -> PrefixCounters:
        return self.counters[turn].minus(self.counters[turn - 1])


def stream_completion(
    session: requests.Session, base: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    """One streamed greedy completion; the client's own first-token time and the usage."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    tokens: list[int] = []
    echo: list[int] | None = None
    usage: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    first: float | None = None
    start = time.perf_counter()
    with session.post(f"{base}/v1/completions", json=body, stream=True, timeout=900) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: ") :])
            if chunk.get("error"):
                raise RuntimeError(f"server error in the stream: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                if choice.get("prompt_token_ids") is not None:
                    echo = list(choice["prompt_token_ids"])
                got = choice.get("token_ids") or []
                if got and first is None:
                    first = time.perf_counter() - start
                tokens.extend(got)
            if chunk.get("usage"):
                usage = chunk["usage"]
                metrics = chunk.get("metrics") or {}
    if first is None:
        raise RuntimeError("no token streamed")
    details = usage.get("prompt_tokens_details") or {}
    return {
        "tokens": tokens,
        "ttft_s": first,
        "e2e_s": time.perf_counter() - start,
        "cached_tokens": details.get("cached_tokens"),
        "server_ttft_ms": metrics.get("time_to_first_token_ms"),
        "server_queue_ms": metrics.get("queue_time_ms"),
        "echo_matches": echo == prompt,
    }


def warm_up(server: Server, w: Workload) -> None:
    """First-call costs (allocations, kernel selection) off the clock; shares no prefix."""
    with requests.Session() as s:
        stream_completion(s, server.base, _tokens(("warm-up", w.seed), w.user_tokens + 17), 4)


def run_conversations(server: Server, w: Workload, config: str, repeat: int = 0) -> RunResult:
    """Drive all conversations through one server; returns every turn's record."""
    records: list[TurnRecord] = []
    counters: list[PrefixCounters] = [server.metrics()]
    errors: list[str] = []
    lock = threading.Lock()

    def read_counters() -> None:
        counters.append(server.metrics())

    barrier = threading.Barrier(w.clients, action=read_counters)
    t0 = time.perf_counter()

    def client(idx: int) -> None:
        mine = [c for c in range(w.conversations) if w.owner(c) == idx]
        history = {c: w.system_prompt() for c in mine}
        try:
            with requests.Session() as session:
                for turn in range(1, w.turns + 1):
                    for c in mine:
                        prompt = history[c] + w.user_message(c, turn)
                        started = time.perf_counter() - t0
                        out = stream_completion(session, server.base, prompt, w.output_tokens)
                        history[c] = prompt + out["tokens"]
                        rec = TurnRecord(
                            config=config,
                            repeat=repeat,
                            conversation=c,
                            turn=turn,
                            client=idx,
                            prompt_tokens=len(prompt),
                            output_token_ids=out["tokens"],
                            ttft_s=out["ttft_s"],
                            e2e_s=out["e2e_s"],
                            start_s=started,
                            cached_tokens=out["cached_tokens"],
                            server_ttft_ms=out["server_ttft_ms"],
                            server_queue_ms=out["server_queue_ms"],
                            prompt_echo_matches=out["echo_matches"],
                        )
                        with lock:
                            records.append(rec)
                    barrier.wait()
        except threading.BrokenBarrierError:
            pass  # another client failed; its error is recorded
        except Exception as exc:  # noqa: BLE001 - recorded and reported, the run goes on
            with lock:
                errors.append(f"client {idx}: {exc!r}")
            barrier.abort()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(w.clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    records.sort(key=lambda r: (r.turn, r.conversation))
    return RunResult(records, counters, wall, errors)
