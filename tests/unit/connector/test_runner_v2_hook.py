"""The Model Runner V2 step-start hook on vLLM's real V2 runner class: it runs before anything
of vLLM's step (where V2 zeroes and copies the step's blocks), never for dummy runs, once per
process, reaches HiMamba connectors inside vLLM's MultiConnector, and can be switched off.

The CPU build cannot run a V2 engine (it needs Triton), so the class is called with a stand-in
``self`` whose first method vLLM's body calls stops the step; the lifecycle tests run the
connector's side of the hook under V2's call order (``tests/lifecycle/runner.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import vllm.distributed.kv_transfer as kv_transfer
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

from himamba.connector.vllm_fixups import runner_v2_hook


class StepBodyReached(Exception):
    """vLLM's own ``execute_model`` body began."""


class StandInSelf:
    """Whatever V2's body calls first ends the step: by then the hook must have run."""

    def __init__(self, calls: list[Any]) -> None:
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        def reached(*args: Any, **kwargs: Any) -> None:
            self._calls.append(("vllm", name))
            raise StepBodyReached(name)

        return reached


class Output:
    """A scheduler output: its metadata, and any other field vLLM reads ends the step."""

    def __init__(self, metadata: Any) -> None:
        self.kv_connector_metadata = metadata

    def __getattr__(self, name: str) -> Any:
        raise StepBodyReached(name)


class Connector:
    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def himamba_step_start(self, metadata: Any) -> None:
        self.calls.append(("hook", metadata))


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A worker's KV-transfer group holding one HiMamba connector; returns the call log."""
    calls: list[Any] = []
    monkeypatch.setattr(kv_transfer, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(kv_transfer, "get_kv_transfer_group", lambda: Connector(calls))
    monkeypatch.delenv(runner_v2_hook.ENV, raising=False)
    assert runner_v2_hook.install_step_hook()
    return calls


def test_hook_runs_before_vllms_step_body_with_the_steps_metadata(group):
    meta = object()
    with pytest.raises(StepBodyReached):
        GPUModelRunner.execute_model(StandInSelf(group), Output(meta))
    assert group[0] == ("hook", meta)
    assert group[1][0] == "vllm"


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_dummy_runs_do_not_call_the_hook(group, how):
    args, kwargs = ((None, True), {}) if how == "positional" else ((), {"dummy_run": True})
    with pytest.raises(StepBodyReached):
        GPUModelRunner.execute_model(StandInSelf(group), Output(object()), *args, **kwargs)
    assert not [c for c in group if c[0] == "hook"]


def test_installed_once_per_process(group):
    wrapped = GPUModelRunner.execute_model
    assert runner_v2_hook.install_step_hook()
    assert GPUModelRunner.execute_model is wrapped
    assert not getattr(wrapped.__wrapped__, "_himamba_step_start", False)


def test_reaches_connectors_inside_vllms_multiconnector(monkeypatch):
    calls: list[Any] = []

    @dataclass
    class MultiMeta:
        metadata: tuple[Any, ...]

    class Multi:
        _connectors = (object(), Connector(calls))

    monkeypatch.setattr(kv_transfer, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(kv_transfer, "get_kv_transfer_group", lambda: Multi())
    runner_v2_hook.step_start(MultiMeta(("other's", "ours")))
    assert calls == [("hook", "ours")]


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(runner_v2_hook.ENV, "0")
    assert not runner_v2_hook.step_hook_available()
    assert not runner_v2_hook.install_step_hook()
