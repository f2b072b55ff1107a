"""Run a scenario (``tests/harness/scenarios.py``) or any harness script in a fresh interpreter
and return the JSON of its ``RESULT`` line.

Children run as modules (``python -m tests.harness.scenarios``) with the repository root on
``PYTHONPATH``, so they import the harness the same way the tests and benchmarks do."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from tests.harness.process_faults import Faults, env_for

REPO = Path(__file__).resolve().parents[2]
FAULTS_BOOT = Path(__file__).resolve().parent / "faults_boot"


def child_env(env: dict[str, str] | None = None, faults: Faults | None = None) -> dict[str, str]:
    """This process's environment plus ``env``, with the repository root (and, for ``faults``,
    the fault start-up hook) first on ``PYTHONPATH``."""
    out = {**os.environ, **(env or {})}
    paths = [str(REPO)]
    if faults:
        paths.insert(0, str(FAULTS_BOOT))
        out.update(env_for(faults))
    if out.get("PYTHONPATH"):
        paths.append(out["PYTHONPATH"])
    out["PYTHONPATH"] = os.pathsep.join(paths)
    return out


def run_scenario(
    name: str,
    args: dict[str, Any],
    timeout: float = 600,
    faults: Faults | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``faults``: patches applied in every process of the scenario (``process_faults``);
    ``env``: extra environment (e.g. a multi-process engine). A plain run forks from the
    pre-imported ``zygote`` when it can, which saves the ~11 s import of a fresh interpreter."""
    raw = json.dumps(args)
    full_env = child_env(env, faults)
    if faults is None and not env:
        out = _ZYGOTE.run(name, raw, full_env, timeout)
        if out is not None:
            return _result(*out, f"scenario {name}")
    argv = ["-m", "tests.harness.scenarios", name, raw]
    return run_script(argv, full_env, timeout, f"scenario {name}")


def run_script(argv: list[str], env: dict[str, str], timeout: float, what: str) -> dict[str, Any]:
    """Run ``python argv...`` and return the JSON of its ``RESULT`` line; fail with the tail of
    its output (naming ``what``) when it printed none."""
    proc = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env
    )
    return _result(proc.returncode, proc.stdout, proc.stderr, what)


def _result(rc: int, stdout: str, stderr: str, what: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (stdout[-3000:] + "\n" + stderr[-6000:]).strip()
    raise AssertionError(f"{what} failed (rc={rc}):\n{tail}")


# Variables that shape the interpreter or vLLM at import time: a request whose values differ
# from the zygote's gets a fresh interpreter instead.
_IMPORT_TIME_PREFIXES = ("VLLM_", "OMP_", "KMP_", "MKL_", "TORCH", "PYTHON", "LD_", "CUDA")


class _Zygote:
    """The pre-imported scenario runner (``zygote.py``), started on first use, one request at
    a time; a request it cannot take (busy, another environment, switched off) returns None."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.env: dict[str, str] = {}
        self.sock = ""
        self.lock = threading.Lock()
        self.broken = os.environ.get("HIMAMBA_TEST_ZYGOTE", "1") == "0"
        self.restarts = 0
        self.used = 0  # requests it ran (tests/harness/test_zygote.py checks it is used)
        atexit.register(self.stop)

    def _compatible(self, env: dict[str, str]) -> bool:
        keys = {k for k in (*env, *self.env) if k.startswith(_IMPORT_TIME_PREFIXES)}
        return all(env.get(k) == self.env.get(k) for k in keys)

    def _start(self, env: dict[str, str]) -> None:
        self.sock = os.path.join(tempfile.mkdtemp(prefix="himamba-zygote-"), "sock")
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.harness.zygote", self.sock],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # an import may print before it is ready
            if line.strip() == "READY":
                return
        self.proc.kill()  # it exited without serving (its error went to stderr)
        self.proc.wait()
        self.proc, self.broken = None, True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if self.sock:
            shutil.rmtree(os.path.dirname(self.sock), ignore_errors=True)

    def run(
        self, name: str, raw: str, env: dict[str, str], timeout: float
    ) -> tuple[int, str, str] | None:
        if self.broken or not self.lock.acquire(blocking=False):
            return None
        try:
            if self.proc is not None and not self._compatible(env) and self.restarts < 3:
                # The environment moved for good (an in-process vLLM import sets LD_PRELOAD,
                # VLLM_WORKER_MULTIPROC_METHOD... in the test process): a zygote of the new one,
                # a few times per session at most.
                self._debug("restarted", env)
                self.stop()
                self.restarts += 1
            if self.proc is None or self.proc.poll() is not None:
                self._start(env)
            if self.proc is None or not self._compatible(env):
                self._debug("not used", env)
                return None
            self.used += 1
            return self._request(name, raw, env, timeout)
        finally:
            self.lock.release()

    def _debug(self, what: str, env: dict[str, str]) -> None:
        if os.environ.get("HIMAMBA_TEST_ZYGOTE_DEBUG"):
            diff = sorted(k for k in {*env, *self.env} if env.get(k) != self.env.get(k))
            print(f"zygote: {what} (environment differs in {diff})", file=sys.stderr)

    def _request(
        self, name: str, raw: str, env: dict[str, str], timeout: float
    ) -> tuple[int, str, str]:
        out_dir = tempfile.mkdtemp(prefix="himamba-scenario-")
        paths = {k: os.path.join(out_dir, k) for k in ("stdout", "stderr")}
        req = {"name": name, "args": raw, "env": env, **paths}
        pid = None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(self.sock)
            conn.sendall(json.dumps(req).encode() + b"\n")
            reader = conn.makefile("r")
            try:
                pid = json.loads(reader.readline())["pid"]
                rc = json.loads(reader.readline())["rc"]
            except TimeoutError:
                if pid is not None:
                    os.killpg(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(f"scenario {name}", timeout) from None
        texts = []
        for k in ("stdout", "stderr"):
            with open(paths[k], errors="replace") as f:
                texts.append(f.read())
        shutil.rmtree(out_dir, ignore_errors=True)
        return rc, texts[0], texts[1]


_ZYGOTE = _Zygote()
