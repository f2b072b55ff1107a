"""Storage fetches wait for the acknowledgements of this engine's own workers only.

vLLM's ``parallel_config.world_size`` is TP x PP, except under ``external_launcher``, where it
is multiplied by the data-parallel size: there every process is an engine with exactly one
worker of its own, and no other worker's output ever reaches its scheduler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.config import ParallelConfig

from himamba.connector.storage_setup import acking_workers
from tests.lifecycle import engine as lifecycle_engine
from tests.lifecycle.workload import prompt_of
from tests.unit.connector.control_engine import build_engine, model_config_in, serve


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return model_config_in(tmp_path_factory.mktemp("acks-model"))


def external_launcher(monkeypatch: pytest.MonkeyPatch, tp: int, dp: int) -> ParallelConfig:
    monkeypatch.setenv("RANK", "0")  # what torchrun sets; vLLM derives the DP rank from it
    return ParallelConfig(
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        distributed_executor_backend="external_launcher",
    )


def test_acknowledging_workers_are_this_engines_workers(monkeypatch):
    assert acking_workers(ParallelConfig()) == 1
    assert acking_workers(ParallelConfig(tensor_parallel_size=2)) == 2
    assert acking_workers(ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)) == 2
    dp_only = external_launcher(monkeypatch, tp=1, dp=2)
    assert dp_only.world_size == 2  # vLLM counts every DP rank here
    assert acking_workers(dp_only) == 1
    # TP ranks under external_launcher are engines of their own too: one worker each.
    assert acking_workers(external_launcher(monkeypatch, tp=2, dp=2)) == 1


def test_a_storage_hit_completes_under_external_launcher_with_data_parallelism(
    model_config, tmp_path: Path, monkeypatch
):
    section = {"url": f"file://{tmp_path}"}
    prompt = prompt_of(11, 80)
    writer = build_engine(model_config, section)
    try:
        serve(writer, "a", prompt)
        writer.runners[0].connector.worker.flush_storage(10)
    finally:
        writer.close()

    real = lifecycle_engine.make_vllm_config
    launched = external_launcher(monkeypatch, tp=1, dp=2)

    def with_external_launcher(spec: Any, mc: Any) -> Any:
        config = real(spec, mc)
        config.parallel_config = launched
        return config

    monkeypatch.setattr(lifecycle_engine, "make_vllm_config", with_external_launcher)
    reader = build_engine(model_config, section)
    try:
        serve(reader, "b", prompt)
        assert reader.hits.storage == 64, reader.connector.stats()
        assert reader.connector.stats()["fetch_fetches_done"] >= 1
    finally:
        reader.close()
