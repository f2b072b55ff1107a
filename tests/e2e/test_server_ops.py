"""Operating the OpenAI server: /metrics per tier and KV events for routers, end to end.

One server as users run it (multi-process engine, storage in a directory, vLLM's ZMQ KV-event
publisher on 127.0.0.1). A prompt is served cold, then from the CPU tier, then, once other
prompts pushed it out of the CPU tier, from storage. After each phase /metrics is scraped and
the event stream a real ZMQ subscriber received is replayed into a router's view.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from himamba.connector.observability.metrics import METRICS, PREFIX
from tests.harness.kv_events import EventSubscriber, RouterView, per_block
from tests.harness.offline_engine import prompt
from tests.harness.openai_server import complete, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.server]

# ~3 MiB: about nine 256 KiB KV blocks (the tiny hybrid's 128-token blocks on CPU), so a few
# 600-token prompts push the first one out of the CPU tier.
CPU_CACHE_GB = 0.003


@pytest.fixture(scope="module")
def ops_server(
    granite_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, EventSubscriber]]:
    tmp = tmp_path_factory.mktemp("server-ops")
    store = tmp / "store"
    store.mkdir()
    sub = EventSubscriber()
    kv_config = {
        "kv_connector": "HiMambaConnector",
        "kv_connector_module_path": "himamba.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "cpu_cache_gb": CPU_CACHE_GB,
            "storage": {"url": f"file://{store}"},
        },
    }
    extra = (
        "--kv-events-config", json.dumps(sub.config()),
        "--worker-extension-cls", "himamba.connector.control.HiMambaWorkerExtension",
    )  # fmt: skip
    try:
        with running_server(granite_model, kv_config, tmp / "server.log", *extra) as base:
            yield base, sub
    finally:
        sub.close()


class Scrape:
    """One GET /metrics, by sample name and labels (vLLM's model_name/engine summed over)."""

    def __init__(self, base: str) -> None:
        text = requests.get(f"{base}/metrics", timeout=10).text
        self.samples: list[tuple[str, dict[str, str], float]] = [
            (s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.samples)

    def get(self, name: str, **labels: str) -> float:
        found = [
            v
            for n, lab, v in self.samples
            if n == name and all(lab.get(k) == x for k, x in labels.items())
        ]
        assert found, f"{name}{labels} not in /metrics"
        return sum(found)

    def block_size(self) -> int:
        return int(next(lab["block_size"] for n, lab, _ in self.samples if "block_size" in lab))


def h(name: str) -> str:
    return PREFIX + name


def kv_blocks(view: RouterView, medium: str) -> dict[int, list[int]]:
    """Block hash -> tokens of every described KV store announced on ``medium``."""
    return per_block(
        [
            ev
            for (m, _), evs in view.stored.items()
            if m == medium
            for ev in evs
            if ev.kv_cache_spec_kind == "full_attention" and ev.block_size
        ]
    )


def held_kv(view: RouterView, medium: str) -> set[int]:
    """KV block hashes a router believes ``medium`` holds (attention groups)."""
    attention = {
        ev.group_idx
        for evs in view.stored.values()
        for ev in evs
        if ev.kv_cache_spec_kind == "full_attention"
    }
    return set().union(*(view.held[(medium, g)] for g in attention))


def wait_for(base: str, ready: Callable[[Scrape], bool], timeout_s: float = 10.0) -> Scrape:
    """Stats reach /metrics a step after the response: scrape until ``ready`` holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = Scrape(base)
        if ready(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def test_metrics_and_kv_events_follow_a_cpu_hit_and_a_storage_hit(ops_server):
    base, sub = ops_server
    start = Scrape(base)
    for m in METRICS.values():  # every series exists before any request
        suffix = {"counter": "_total", "histogram": "_count"}.get(m.kind.value, "")
        assert start.has(h(m.name) + suffix), m.name
    bs = start.block_size()
    a = prompt(71, 600)
    hit = (len(a) - 1) // bs * bs

    # Phase 1: cold, then a CPU-tier hit once vLLM's own copy is gone.
    cold = complete(base, a)
    assert requests.post(f"{base}/reset_prefix_cache", timeout=30).status_code == 200
    assert complete(base, a) == cold
    s1 = wait_for(base, lambda s: s.get(h("hit_tokens_total"), tier="cpu") >= hit)
    assert s1.get(h("hit_tokens_total"), tier="cpu") == hit
    assert s1.get(h("hit_tokens_total"), tier="storage") == 0
    assert s1.get(h("stores_total"), tier="cpu", object="kv") >= hit // bs
    assert s1.get(h("stores_total"), tier="cpu", object="mamba") >= 1
    assert (
        0 < s1.get(h("cpu_slots_used"), object="kv") <= s1.get(h("cpu_slots_capacity"), object="kv")
    )
    assert s1.get(h("load_seconds_count")) == 1
    assert s1.get(h("load_bytes_sum")) > 0
    assert s1.get(h("store_bytes_sum")) > 0
    view = RouterView(sub.drain())
    assert any(m == "GPU" for m, _ in view.held), "vLLM's own GPU events share the stream"
    chunks = [a[i : i + bs] for i in range(0, hit, bs)]
    a_hashes = {x for x, toks in kv_blocks(view, "CPU").items() if toks in chunks}
    assert len(a_hashes) == hit // bs  # every block of A's hit announced, with its tokens
    assert a_hashes <= held_kv(view, "CPU")

    # Phase 2: other prompts push A out of the CPU tier (write-through keeps it in storage).
    for i in range(12):
        complete(base, prompt(200 + i, 600))
        view = RouterView(sub.drain())
        if not a_hashes & held_kv(view, "CPU"):
            break
    else:
        raise AssertionError("A never left the CPU tier")
    assert a_hashes <= held_kv(view, "STORAGE")  # written through, announced (vLLM's medium)
    s2 = Scrape(base)
    assert s2.get(h("evictions_total"), tier="cpu", object="kv") >= hit // bs
    assert s2.get(h("stores_total"), tier="storage", object="kv") > 0
    assert s2.get(h("storage_op_seconds_count"), op="write") > 0

    # Phase 3: A again, without vLLM's copy: fetched from storage into the CPU tier.
    assert requests.post(f"{base}/reset_prefix_cache", timeout=30).status_code == 200
    assert complete(base, a) == cold
    s3 = wait_for(base, lambda s: s.get(h("hit_tokens_total"), tier="storage") >= hit)
    assert s3.get(h("hit_tokens_total"), tier="storage") == hit
    assert s3.get(h("hit_tokens_total"), tier="cpu") == hit  # unchanged since phase 1
    assert s3.get(h("storage_fetches_total"), outcome="ok") >= hit // bs
    assert s3.get(h("storage_op_seconds_count"), op="fetch") >= 1
    assert s3.get(h("storage_op_bytes_sum"), op="fetch") > 0
    assert s3.get(h("load_seconds_count")) == 2
    assert s3.get(h("storage_breaker_state")) == 0
    for kind in ("timeout", "checksum", "invalid", "missing", "backend"):
        assert s3.get(h("storage_errors_total"), kind=kind) == 0, kind
    # Fetched into the CPU tier, and announced (with tokens) when the request loaded them.
    view = RouterView(sub.drain())
    assert a_hashes <= held_kv(view, "CPU")


def control(base: str, *args: str) -> list[dict]:
    body = {"method": "himamba_control", "args": list(args)}
    resp = requests.post(f"{base}/collective_rpc", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["results"]


def settle(base: str, want: str, scheduler: bool = True, timeout_s: float = 60) -> list[dict]:
    """Status until every rank (and the scheduler half) report ``want``. A rank's store goes
    live at a call or step once it is open; the scheduler half hears of it with the next step,
    so a request is served meanwhile whenever the engine would otherwise sit idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = control(base, "status")
        if all(s["storage"] == want and (s["scheduler"] == want or not scheduler) for s in status):
            return status
        assert time.monotonic() < deadline, f"storage never settled on {want}: {status}"
        if scheduler:
            complete(base, prompt(499, 40))
        time.sleep(0.1)


def test_storage_is_detached_and_attached_over_http(ops_server, tmp_path):
    base, _ = ops_server
    assert [r["storage"] for r in control(base, "status")] == ["attached"]
    assert [r["storage"] for r in control(base, "detach_storage")] == ["detached"]
    complete(base, prompt(401, 300))  # serving goes on, without storage
    settle(base, "detached")
    other = json.dumps({"url": f"file://{tmp_path}"})
    attached = control(base, "attach_storage", other)
    # Answered at once, before the store is open; it goes live in the background.
    assert attached[0]["storage"] == "attaching" and attached[0]["target"] == f"file://{tmp_path}"
    settle(base, "attached", scheduler=False)
    complete(base, prompt(402, 300))
    settle(base, "attached")
    deadline = time.monotonic() + 30
    while not list(tmp_path.rglob("*@0@*.data")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(tmp_path.rglob("*@0@*.data")), "nothing was written to the newly attached store"
    bad = requests.post(
        f"{base}/collective_rpc",
        json={"method": "himamba_control", "args": ["explode"]},
        timeout=60,
    )
    assert bad.status_code >= 400 or "unknown action" in bad.text
    bad_section = json.dumps({"url": "ftp://nowhere/x"})
    bad = requests.post(
        f"{base}/collective_rpc",
        json={"method": "himamba_control", "args": ["attach_storage", bad_section]},
        timeout=60,
    )
    assert bad.status_code >= 400 or "storage.url" in bad.text
    # A bad call is an error for its caller, not for the engine: it keeps serving.
    assert [r["storage"] for r in control(base, "status")] == ["attached"]
    assert len(complete(base, prompt(403, 200))) == 16
