"""Real storage backends for tests: a private redis-server on 127.0.0.1 and a scratch directory.

A real server, not fakeredis: LMCache's RESP adapter is C++ speaking the wire protocol, and the
behaviours we guard against (no reconnect, reply desync) only exist against the real thing.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; kill/restart keep the port so clients can come back."""

    host = "127.0.0.1"

    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", self.host, "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not come up on port {self.port}")

    def kill(self) -> None:
        """SIGKILL: an outage, with all (unpersisted) data lost."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections open, no replies) - a deadline, not an error."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self):  # redis-py, for poking at stored bytes
        import redis

        return redis.Redis(host=self.host, port=self.port)


def require_redis_server() -> None:
    """Skip (with how to install it) where there is no redis-server; `make test` installs it."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server; make test does)")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis_server()
    srv = RedisServer(tmp_path)
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture
def storage_dir(tmp_path: Path) -> Path:
    d = tmp_path / "himamba-store"
    d.mkdir()
    return d
