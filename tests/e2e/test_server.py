"""The OpenAI-compatible server with the connector: CPU-tier hits through HTTP, same tokens.

The server runs as users run it (multi-process engine: scheduler half in the engine-core
process, worker half in the worker process) on 127.0.0.1 only.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.harness.offline_engine import prompt
from tests.harness.openai_server import complete, running_server
from tests.harness.subprocess_run import run_scenario

pytestmark = [pytest.mark.e2e, pytest.mark.server]

KV_CONFIG = {
    "kv_connector": "HiMambaConnector",
    "kv_connector_module_path": "himamba.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"cpu_cache_gb": 0.05},
}


@pytest.fixture(scope="module")
def server(granite_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(granite_model, KV_CONFIG, log) as base:
        yield base


def external_hits(base: str) -> float:
    text = requests.get(f"{base}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"vllm:external_prefix_cache_hits(?:_total)?(?:\{[^}]*\})? ([0-9.e+]+)$", line)
        if m:
            total += float(m.group(1))
    return total


def test_server_serves_cpu_tier_hit_with_tokens_of_a_connectorless_engine(server, granite_model):
    a = prompt(1, 1000)
    base = run_scenario("baseline", {"model": str(granite_model), "prompts": [a]})
    ref, block = base["single"][0], base["block_size"]
    cold = complete(server, a)
    assert requests.post(f"{server}/reset_prefix_cache", timeout=30).status_code == 200
    hits_before = external_hits(server)
    warm = complete(server, a)
    assert cold == ref["tokens"]
    assert warm == ref["tokens"]
    # Every whole block before the last prompt token came through the connector.
    assert external_hits(server) - hits_before == (len(a) - 1) // block * block


def test_server_chat_request_with_text_works_and_repeats_identically(server):
    words = " ".join(f"t{7 + i % 1000}" for i in range(600))
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": words}],
        "max_tokens": 8,
        "temperature": 0,
    }
    first = requests.post(f"{server}/v1/chat/completions", json=body, timeout=120)
    assert first.status_code == 200, first.text
    requests.post(f"{server}/reset_prefix_cache", timeout=30)
    second = requests.post(f"{server}/v1/chat/completions", json=body, timeout=120)
    assert second.status_code == 200, second.text
    assert first.json()["choices"][0]["message"] == second.json()["choices"][0]["message"]


@pytest.fixture(scope="module")
def block(granite_model: Path) -> int:
    """The engine's scheduler block size (vLLM derives it at start-up)."""
    return run_scenario("baseline", {"model": str(granite_model), "prompts": [prompt(3, 8)]})[
        "block_size"
    ]


def chat(base: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        # Keep special ids (pad/bos/eos/unk) out of the answer, so its text re-tokenizes to
        # the very ids generated and turn 2's rendered prompt extends turn 1's token for token.
        "logit_bias": {str(i): -100 for i in range(7)},
    }
    resp = requests.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_second_chat_turn_hits_through_the_first_answer(server, block):
    first = [{"role": "user", "content": " ".join(f"t{11 + i % 900}" for i in range(560))}]
    r1 = chat(server, first, max_tokens=160)
    answer = r1["choices"][0]["message"]["content"]
    p1, c1 = r1["usage"]["prompt_tokens"], r1["usage"]["completion_tokens"]
    second = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": " ".join(f"t{500 + i}" for i in range(40))},
    ]
    assert requests.post(f"{server}/reset_prefix_cache", timeout=30).status_code == 200
    before = external_hits(server)
    r2 = chat(server, second, max_tokens=8)
    hits = external_hits(server) - before
    p2 = r2["usage"]["prompt_tokens"]
    assert p2 > p1 + c1  # the rendered conversation: turn 1, its answer, the new message
    # Through turn 1's answer, to the last block boundary vLLM computed in turn 1.
    assert hits == (p1 + c1 - 1) // block * block
    assert hits > (p1 - 1) // block * block  # deeper than turn 1's prompt alone
    # And the hit changes nothing: the same turn recomputed from scratch answers the same.
    requests.post(f"{server}/reset_prefix_cache?reset_external=true", timeout=30)
    again = chat(server, second, max_tokens=8)
    assert again["choices"][0]["message"] == r2["choices"][0]["message"]
