"""A storage password never shows: not in logs (start-up, run-time attach, errors), not in the
control call's answers, not in ``StorageConfig``'s repr; and it can come from the environment
(``password_env``), so it need not sit in ``kv_connector_extra_config``, which vLLM logs."""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from himamba.connector.protocol import ControlAction
from himamba.tiers.storage_config import StorageConfig, redacted_url
from tests.harness.redis_server import require_redis_server
from tests.lifecycle.workload import prompt_of
from tests.unit.connector.control_engine import (
    control,
    engine_of,
    model_config_in,
    serve,
    step_until,
    switched,
)

PASSWORD = "s3cret-Pw9"
ENV = "HIMAMBA_TEST_REDIS_PASSWORD"


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return model_config_in(tmp_path_factory.mktemp("secrets-model"))


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A private redis-server on 127.0.0.1 that requires ``PASSWORD``."""
    require_redis_server()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
         "--appendonly", "no", "--dir", str(workdir), "--requirepass", PASSWORD],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        yield port
    finally:
        proc.kill()
        proc.wait()


class Captured(logging.Handler):
    """Every record of the loggers that could print a storage section, formatted."""

    NAMES = ("", "himamba", "vllm", "lmcache")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def logs() -> Iterator[Captured]:
    handler = Captured()
    loggers = [logging.getLogger(n) for n in Captured.NAMES]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)


def test_repr_target_and_errors_hide_the_password():
    url = f"redis://alice:{PASSWORD}@127.0.0.1:6390"
    cfg = StorageConfig.from_dict({"url": url})
    assert cfg.adapter["password"] == PASSWORD  # the adapter still gets it
    assert PASSWORD not in repr(cfg) and PASSWORD not in str(cfg)
    assert cfg.target == "redis://alice:***@127.0.0.1:6390" == redacted_url(url)
    passthrough = StorageConfig.from_dict({"adapter": {"type": "resp", "host": "h", "port": 1,
                                                       "password": PASSWORD}})  # fmt: skip
    assert PASSWORD not in repr(passthrough) and PASSWORD not in passthrough.target
    # A bad port, database, or a password that (unencoded) breaks the URL's split.
    for bad in (f"redis://:{PASSWORD}@h:99999", f"redis://:{PASSWORD}@h:1/3", "redis://:a/b@h"):
        with pytest.raises(ValueError, match=r"storage\.url") as err:
            StorageConfig.from_dict({"url": bad})
        assert PASSWORD not in str(err.value) and "a/b" not in str(err.value)
    assert redacted_url("file:///data/kv") == "file:///data/kv"
    assert redacted_url("redis://bob@h:1") == "redis://bob@h:1"  # a user name is no secret


def test_the_password_can_come_from_an_environment_variable(monkeypatch):
    monkeypatch.setenv(ENV, PASSWORD)
    cfg = StorageConfig.from_dict({"url": "redis://127.0.0.1:6390", "password_env": ENV})
    assert cfg.adapter["password"] == PASSWORD and PASSWORD not in repr(cfg)
    monkeypatch.delenv(ENV)
    with pytest.raises(ValueError, match=rf"storage\.password_env: environment variable {ENV}"):
        StorageConfig.from_dict({"url": "redis://127.0.0.1:6390", "password_env": ENV})
    monkeypatch.setenv(ENV, PASSWORD)
    with pytest.raises(ValueError, match=r"storage\.password_env: .*already carries"):
        StorageConfig.from_dict({"url": "redis://:x@127.0.0.1:6390", "password_env": ENV})
    with pytest.raises(ValueError, match=r"storage\.password_env: a file store"):
        StorageConfig.from_dict({"url": "file:///tmp/x", "password_env": ENV})


def test_no_password_in_logs_or_status_at_start_up_and_at_attach(
    model_config, redis_port, logs, tmp_path: Path, monkeypatch
):
    url = f"redis://:{PASSWORD}@127.0.0.1:{redis_port}"
    with engine_of(model_config, {"url": url}) as engine:
        serve(engine, "a", prompt_of(21, 80))
        worker = engine.runners[0].connector.worker
        worker.flush_storage(10)
        assert worker.storage.counters["storage_puts_ok"] > 0  # the password was used
        (status,) = control(engine, ControlAction.STATUS)
        assert status["target"] == f"redis://:***@127.0.0.1:{redis_port}"

        # Attached at run time: from the environment, then inline again.
        monkeypatch.setenv(ENV, PASSWORD)
        from_env = {"url": f"redis://127.0.0.1:{redis_port}", "password_env": ENV}
        answers = control(engine, ControlAction.ATTACH, from_env)
        step_until(engine, lambda: switched(engine, from_env["url"]))
        serve(engine, "b", prompt_of(22, 80))
        worker.flush_storage(10)
        assert worker.storage.counters["storage_puts_ok"] > 0
        inline = {"url": url, "write_policy": "write_back"}
        answers += control(engine, ControlAction.ATTACH, inline)
        step_until(engine, lambda: switched(engine, url))
        answers += control(engine, ControlAction.STATUS)
        answers += control(engine, ControlAction.DETACH)
    shown = [str(a) for a in answers] + logs.lines
    assert any("***" in line for line in shown)
    leaks = [line for line in shown if PASSWORD in line]
    assert not leaks, leaks[:3]
