"""Fixtures of the scheduler-level lifecycle suite: one shared ModelConfig, engines that are
closed after each test, and a scratch LMCache store directory."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .engine import LifecycleEngine
from .vllm_setup import EngineSpec, make_model_config, write_model_dir

# Small CPU tier: 0.5 MiB = 192 KV slots (2 KiB each) + 292 Mamba slots (448 B each), so
# longer tests evict and the storage tier is exercised.
CPU_CACHE_GB = 0.5 / 1024


@pytest.fixture(scope="session")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One ModelConfig for the session (deep-copied per engine): building it inspects the
    architecture in a subprocess, which costs seconds on a cold machine."""
    model_dir = write_model_dir(tmp_path_factory.mktemp("lifecycle-model"))
    return make_model_config(model_dir, max_model_len=EngineSpec().max_model_len)


@pytest.fixture(autouse=True)
def _quiet_vllm() -> Iterator[None]:
    """vLLM logs a warning per connector construction; hundreds of engines drown real output."""
    loggers = [logging.getLogger(n) for n in ("vllm", "himamba")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    yield
    for lg, level in zip(loggers, levels, strict=True):
        lg.setLevel(level)


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    d = tmp_path / "himamba-store"
    d.mkdir()
    return f"file://{d}"


def connector_config(store_url: str | None = None, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"cpu_cache_gb": CPU_CACHE_GB}
    if store_url is not None:
        cfg["storage"] = {"url": store_url, **extra.pop("storage", {})}
    cfg.update(extra)
    return cfg


@pytest.fixture
def make_engine(model_config: Any) -> Iterator[Callable[..., LifecycleEngine]]:
    """``make_engine(spec_field=value, ...)`` builds an engine from EngineSpec defaults."""
    engines: list[LifecycleEngine] = []

    def build(verify: bool = True, describe: bool = True, **fields: Any) -> LifecycleEngine:
        spec = dataclasses.replace(EngineSpec(), **fields)
        engine = LifecycleEngine(spec, model_config, verify=verify, describe=describe)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()
