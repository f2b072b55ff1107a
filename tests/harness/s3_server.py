"""A real S3 API on 127.0.0.1 for the tests: moto's server (`moto[server]`), one bucket.

LMCache's s3 adapter addresses the bucket virtual-hosted style, so `BUCKET.localhost` must
resolve: the fixture adds it to /etc/hosts when it is missing and the file is writable (CI runs
as root; `.ci/run` adds it too) and otherwise fails with the line to add. Credentials are moto's
dummy ones, exported to the environment so engine subprocesses resolve them through boto3
like a real deployment would.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.redis_server import _free_port

BUCKET = "himamba-test"
REGION = "us-east-1"
HOSTS_LINE = f"127.0.0.1 {BUCKET}.localhost"


def _moto_server() -> str:
    beside = Path(sys.executable).with_name("moto_server")
    found = str(beside) if beside.exists() else shutil.which("moto_server")
    if not found:
        raise RuntimeError("moto_server not found: pip install 'moto[server]' (the test extra)")
    return found


def ensure_bucket_host() -> None:
    """`BUCKET.localhost` resolves to 127.0.0.1, or a clear error says how to make it so."""
    name = f"{BUCKET}.localhost"
    try:
        socket.gethostbyname(name)
        return
    except OSError:
        pass
    try:
        with open("/etc/hosts", "a") as f:
            f.write(f"\n{HOSTS_LINE}\n")
    except OSError as e:
        raise RuntimeError(f"{name} does not resolve; add '{HOSTS_LINE}' to /etc/hosts") from e
    socket.gethostbyname(name)


class S3Server:
    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.log = workdir / f"moto-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"s3://{BUCKET}?region={REGION}&endpoint=http://localhost:{self.port}"

    def start(self) -> None:
        cmd = [_moto_server(), "-H", "127.0.0.1", "-p", str(self.port)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{self.port}/{BUCKET}", method="PUT")
                urllib.request.urlopen(req, timeout=2).close()  # creates the bucket
                return
            except OSError as e:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    tail = self.log.read_text()[-2000:]
                    raise RuntimeError(f"moto_server did not start: {tail}") from e
                time.sleep(0.2)

    def client(self):  # boto3 (moto's dependency), to poke at stored bytes
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.port}",
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def object_count(self) -> int:
        return self.client().list_objects_v2(Bucket=BUCKET).get("KeyCount", 0)

    def get_object(self, name: str) -> bytes:
        return self.client().get_object(Bucket=BUCKET, Key=name)["Body"].read()

    def put_object(self, name: str, data: bytes) -> None:
        self.client().put_object(Bucket=BUCKET, Key=name, Body=data)

    def has_object(self, name: str) -> bool:
        found = self.client().list_objects_v2(Bucket=BUCKET, Prefix=name)
        return any(o["Key"] == name for o in found.get("Contents", ()))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture
def s3_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    ensure_bucket_host()
    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    srv = S3Server(tmp_path)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
