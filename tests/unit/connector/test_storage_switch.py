"""Run-time storage attach and detach never stall or crash the engine loop.

vLLM's real scheduler drives both connector roles (``lifecycle.engine``); the control call is
what ``collective_rpc("himamba_control")`` runs on each worker, between two steps. The slow
parts of a switch (fingerprinting the checkpoint, closing a store) are held back by a gate, and
every call the engine loop makes must still return at once; stores that cannot be opened are
refused while the engine keeps the store it had.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.outputs import KVConnectorOutput

import himamba.connector.weights_identity as weights_identity_module
import himamba.connector.worker.worker_storage as worker_storage_module
from himamba.connector.protocol import ControlAction, ControlRequest, HiMambaWorkerMeta
from himamba.tiers.lmcache_store import LMCacheStore
from tests.lifecycle.workload import prompt_of
from tests.unit.connector.control_engine import (
    Gate,
    control,
    engine_of,
    model_config_in,
    objects_in,
    serve,
    step_until,
    switched,
    within,
)

# A call on the engine loop "returned at once" if it took less than this (the gate holds the
# slow part for a minute).
PROMPT_S = 3.0


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return model_config_in(tmp_path_factory.mktemp("switch-model"))


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path / "store"
    folder.mkdir()
    return folder, {"url": f"file://{folder}"}


def slow_fingerprint(monkeypatch: pytest.MonkeyPatch) -> Gate:
    gate = Gate()
    monkeypatch.setattr(
        weights_identity_module,
        "weights_identity",
        gate.wrap(weights_identity_module.weights_identity),
    )
    return gate


def scheduler_output(*requests: ControlRequest) -> KVConnectorOutput:
    return KVConnectorOutput(kv_connector_worker_meta=HiMambaWorkerMeta([], list(requests)))


def test_attach_answers_at_once_and_goes_live_once_the_store_is_open(
    model_config, store, monkeypatch
):
    folder, section = store
    with engine_of(model_config) as engine:
        gate = slow_fingerprint(monkeypatch)
        try:
            returned, answers = within(
                lambda: control(engine, ControlAction.ATTACH, section), PROMPT_S
            )
            assert returned, "the control call waited for the checkpoint fingerprint"
            assert [a["storage"] for a in answers] == ["attaching"]
            assert answers[0]["target"] == section["url"]
            assert gate.entered.wait(10)  # the fingerprint runs meanwhile, off the loop
            # The engine keeps serving (without storage) while the store is prepared.
            returned, _ = within(lambda: serve(engine, "a", prompt_of(1, 80)), 30)
            assert returned
            assert engine.runners[0].connector.worker.storage is None
            assert engine.connector.scheduler.storage is None
        finally:
            gate.open()
        step_until(engine, lambda: switched(engine, section["url"]))
        serve(engine, "b", prompt_of(2, 80))
        engine.runners[0].connector.worker.flush_storage(10)
        assert objects_in(folder) > 0


def test_the_scheduler_half_prepares_its_store_off_the_step(model_config, store, monkeypatch):
    _, section = store
    with engine_of(model_config) as engine:
        conn = engine.connector
        gate = slow_fingerprint(monkeypatch)
        try:
            attach = ControlRequest(ControlAction.ATTACH, json.dumps(section))
            returned, _ = within(
                lambda: conn.update_connector_output(scheduler_output(attach)), PROMPT_S
            )
            assert returned, "update_connector_output waited for the probe store"
            assert conn.scheduler.storage is None
            assert conn.has_pending_push_work()  # vLLM keeps stepping until it is switched in
        finally:
            gate.open()
        step_until(engine, lambda: conn.scheduler.storage is not None)
        assert conn.scheduler.storage.cfg.url == section["url"]
        assert not conn.has_pending_push_work()


def test_detach_closes_the_old_stores_off_the_loop(model_config, store, monkeypatch):
    folder, section = store
    with engine_of(model_config, section) as engine:
        serve(engine, "a", prompt_of(3, 80))
        engine.runners[0].connector.worker.flush_storage(10)
        before = objects_in(folder)
        gate = Gate()
        monkeypatch.setattr(LMCacheStore, "close", gate.wrap(LMCacheStore.close))
        try:
            returned, answers = within(lambda: control(engine, ControlAction.DETACH), PROMPT_S)
            assert returned, "the control call waited for the store to close"
            assert [a["storage"] for a in answers] == ["detached"]
            # The scheduler half follows in the next step, without waiting for its close.
            returned, _ = within(lambda: engine.idle_steps(2), PROMPT_S)
            assert returned, "an engine step waited for the probe store to close"
            assert engine.connector.scheduler.storage is None
            assert gate.entered.wait(10)  # the closes run, in the background
            serve(engine, "b", prompt_of(4, 80))  # served without storage
            assert objects_in(folder) == before
        finally:
            gate.open()
        assert engine.connector.stats()["storage_stores_closing"] >= 0
        step_until(engine, lambda: engine.connector.stats()["storage_stores_closing"] == 0)


@pytest.mark.parametrize("why", ["bad adapter spec", "weights file missing"])
def test_a_store_that_cannot_be_opened_is_refused_and_the_old_one_keeps_serving(
    model_config, store, tmp_path, why
):
    folder, section = store
    weights = Path(model_config.model) / "model.safetensors"
    hidden = weights.with_suffix(".hidden")
    if why == "bad adapter spec":
        other: dict[str, Any] = {"adapter": {"type": "fs_native"}}  # no base_path
    else:
        other = {"url": f"file://{tmp_path}", "weights_fingerprint": "full"}
    with engine_of(model_config, section) as engine:
        conn = engine.connector
        if why == "weights file missing":
            weights.rename(hidden)
        try:
            answers = control(engine, ControlAction.ATTACH, other)
            assert [a["storage"] for a in answers] == ["attaching"]
            step_until(engine, lambda: control(engine, ControlAction.STATUS)[0]["error"])
            # The scheduler half refuses too (here: a report no worker would send), and goes on.
            bad = ControlRequest(ControlAction.ATTACH, json.dumps(other))
            conn.update_connector_output(scheduler_output(bad))
            step_until(engine, lambda: conn.stats()["storage_attach_refused"] == 1)
        finally:
            if hidden.exists():
                hidden.rename(weights)
        (status,) = control(engine, ControlAction.STATUS)
        assert status["storage"] == "attached" and status["target"] == section["url"]
        assert "failed" in status["error"]
        assert conn.scheduler.storage is not None
        assert conn.scheduler.storage.cfg.url == section["url"]
        before = objects_in(folder)
        serve(engine, "a", prompt_of(5, 80))
        engine.runners[0].connector.worker.flush_storage(10)
        assert objects_in(folder) > before  # still writing to the store it had


def test_a_storage_section_with_an_error_fails_the_call_naming_the_field(model_config, store):
    _, section = store
    with engine_of(model_config, section) as engine:
        with pytest.raises(ValueError, match=r"storage\.url"):
            control(engine, ControlAction.ATTACH, {"url": "ftp://host/x"})
        with pytest.raises(ValueError, match=r"storage\.write_policy"):
            control(engine, ControlAction.ATTACH, {**section, "write_policy": "sometimes"})
        (status,) = control(engine, ControlAction.STATUS)
        assert status["storage"] == "attached" and status["error"] is None
        serve(engine, "a", prompt_of(6, 80))


def test_switches_on_two_ranks_converge_on_the_last_one(model_config, store, tmp_path):
    _, section = store
    others = []
    for i in range(2):
        (tmp_path / f"other{i}").mkdir()
        others.append({"url": f"file://{tmp_path}/other{i}"})
    with engine_of(model_config, section, tensor_parallel_size=2) as engine:
        control(engine, ControlAction.ATTACH, others[0])
        control(engine, ControlAction.ATTACH, others[1])  # before the first went live
        step_until(engine, lambda: switched(engine, others[1]["url"]))
        control(engine, ControlAction.DETACH)
        step_until(engine, lambda: switched(engine, None))
        serve(engine, "a", prompt_of(7, 80))
        control(engine, ControlAction.ATTACH)  # the configured store again
        step_until(engine, lambda: switched(engine, section["url"]))


def test_a_switch_that_fails_at_the_step_boundary_leaves_both_halves_detached(
    model_config, store, tmp_path, monkeypatch
):
    _, section = store

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected: the worker could not take the store")

    with engine_of(model_config, section) as engine:
        monkeypatch.setattr(worker_storage_module, "WorkerStorage", broken)
        other = {"url": f"file://{tmp_path}"}
        control(engine, ControlAction.ATTACH, other)
        step_until(engine, lambda: control(engine, ControlAction.STATUS)[0]["error"])
        monkeypatch.undo()
        (status,) = control(engine, ControlAction.STATUS)
        assert "injected" in status["error"] and status["storage"] == "detached"
        step_until(engine, lambda: switched(engine, None))  # the scheduler half followed
        serve(engine, "a", prompt_of(8, 80))  # and the engine serves on
