"""A pre-imported interpreter that forks one child per engine scenario (tests only).

Each scenario runs in a process of its own (``scenarios.py`` says why), and a fresh interpreter
spends ~11 s of a ~16 s scenario importing vLLM and torch on the 2-core CI box: most of the
suite's time. This process imports them once, with no thread started (forking a process that
runs threads can deadlock the child), then serves requests on a Unix socket one at a time: it
forks, the child takes the requester's whole environment and output files and runs the scenario
exactly as ``python -m tests.harness.scenarios`` would (its ``RESULT`` line included) and exits
through the normal interpreter shutdown; the parent reports the child's pid, then its exit code.

``subprocess_run`` uses it only for plain scenario runs whose vLLM / threading environment equals
the one it was started with (no fault hooks, no extra variables); everything else, and everything
when ``HIMAMBA_TEST_ZYGOTE=0``, still gets a fresh interpreter.

    python -m tests.harness.zygote SOCKET_PATH     (started by subprocess_run)
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import traceback


def _read_line(conn: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("requester went away")
        buf += chunk
    return buf


def _child(req: dict, scenarios) -> None:  # noqa: ANN001 (the scenarios module)
    """Run one scenario in this forked child; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # the requester can kill the child and its engine's workers at once
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        sys.argv = ["tests.harness.scenarios", req["name"], req["args"]]
        scenarios.run(req["name"], req["args"])
        code = 0
    except BaseException:  # noqa: BLE001 (reported in the child's stderr like a crash would be)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)  # the interpreter's normal shutdown, as a fresh process would have


# What a scenario's engine imports (vLLM imports lazily): loaded once here. A module that
# another vLLM lacks is skipped; the child imports whatever is still missing itself.
PRELOAD = (
    "vllm.entrypoints.llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.models.granitemoehybrid",
    "vllm.model_executor.models.qwen3_next",
    "vllm.model_executor.models.lfm2",
    "himamba.connector.vllm_connector",
)


def serve(path: str) -> None:
    import importlib

    import tests.harness.scenarios as scenarios

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if threading.active_count() != 1:
        raise SystemExit(f"zygote: {threading.active_count()} threads after imports; not forking")
    me = os.getpid()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    print("READY", flush=True)
    while True:
        conn, _ = srv.accept()
        try:
            req = json.loads(_read_line(conn))
        except (ConnectionError, ValueError):
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            srv.close()
            conn.close()
            _child(req, scenarios)
        assert os.getpid() == me
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            _, status = os.waitpid(pid, 0)
            conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        except OSError:
            pass  # the requester gave up (timeout) and killed the child
        finally:
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
