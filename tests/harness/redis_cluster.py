"""A real 3-node Redis Cluster on loopback, for tests and benchmarks.

Each node is a `redis-server --cluster-enabled yes` process in its own directory (its
`nodes.conf` lives there), on a free port; `redis-cli --cluster create` assigns the 16384
slots over the three (no replicas). `kill(i)` is a node's outage (SIGKILL, its data gone; with
`full_coverage=False`, the default here, the other nodes keep serving their slots);
`restart(i)` brings it back with the same `nodes.conf`, so it rejoins owning the same slots
(empty: nothing is persisted) and the cluster heals without operator action.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

HOST = "127.0.0.1"


def _free_ports(n: int) -> list[int]:
    """`n` distinct free ports whose cluster-bus ports (port + 10000) are free too."""
    ports: list[int] = []
    socks: list[socket.socket] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port + 10000 > 65535:
                continue
            with socket.socket() as bus:
                try:
                    bus.bind((HOST, port + 10000))
                except OSError:
                    continue
            ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def _ping(port: int) -> bytes:
    with socket.create_connection((HOST, port), timeout=0.5) as c:
        c.sendall(b"PING\r\n")
        return c.recv(64)


def _cli(port: int, *args: str, timeout: float = 10) -> str:
    out = subprocess.run(
        ["redis-cli", "-h", HOST, "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out.stdout


class RedisCluster:
    """Three cluster nodes; `nodes[i]` is a port. `url` seeds a client with every node."""

    def __init__(self, workdir: Path, size: int = 3, full_coverage: bool = False) -> None:
        self.workdir = workdir
        # Redis's default (yes) makes every node refuse every key (CLUSTERDOWN) once one
        # primary is seen failed (after cluster-node-timeout): one dead node is then a whole
        # outage. "no" keeps the live nodes serving their own slots.
        self.full_coverage = full_coverage
        self.ports = _free_ports(size)
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size

    @property
    def seeds(self) -> str:
        return ",".join(f"{HOST}:{p}" for p in self.ports)

    @property
    def url(self) -> str:
        return f"redis+cluster://{self.seeds}"

    def _dir(self, i: int) -> Path:
        d = self.workdir / f"node{i}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _start_node(self, i: int) -> None:
        d = self._dir(i)
        self.procs[i] = subprocess.Popen(
            ["redis-server", "--bind", HOST, "--port", str(self.ports[i]),
             "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
             "--cluster-node-timeout", "2000",
             "--cluster-require-full-coverage", "yes" if self.full_coverage else "no",
             "--cluster-allow-reads-when-down", "no" if self.full_coverage else "yes",
             "--dir", str(d), "--save", "",
             "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if _ping(self.ports[i]).startswith(b"+PONG"):
                    return
            except OSError:
                if self.procs[i].poll() is not None:  # e.g. another process took the port
                    self.procs[i] = None
                    break
                time.sleep(0.02)
        raise RuntimeError(f"cluster node {i} did not come up on port {self.ports[i]}")

    def start(self) -> None:
        for i in range(len(self.ports)):
            for attempt in range(3):
                try:
                    self._start_node(i)
                    break
                except RuntimeError:
                    # A free port found earlier can be taken before redis-server binds it (other
                    # test processes pick ports too): before the cluster exists, take another.
                    if attempt == 2:
                        raise
                    self.kill(i)
                    taken = set(self.ports)
                    self.ports[i] = next(p for p in _free_ports(4) if p not in taken)
        out = subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"{HOST}:{p}" for p in self.ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
        self.wait_ok()

    def wait_ok(self, timeout: float = 15) -> None:
        """Until every live node reports `cluster_state:ok` (all slots served)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [
                _cli(p, "cluster", "info")
                for i, p in enumerate(self.ports)
                if self.procs[i] is not None
            ]
            if states and all("cluster_state:ok" in s for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError("redis cluster did not reach cluster_state:ok")

    def kill(self, i: int) -> None:
        """SIGKILL node `i`: its slots are unserved (no replica), its data lost."""
        proc = self.procs[i]
        if proc is not None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
            self.procs[i] = None

    def restart(self, i: int) -> None:
        """Node `i` back on its port with its `nodes.conf`: same slots, no data."""
        self.kill(i)
        self._start_node(i)
        self.wait_ok()

    def stop(self) -> None:
        for i in range(len(self.ports)):
            self.kill(i)

    def node_of(self, key: bytes | str) -> int:
        """Index of the node serving `key`'s slot."""
        import redis

        live = next(p for i, p in enumerate(self.ports) if self.procs[i] is not None)
        slot = int(redis.Redis(host=HOST, port=live).execute_command("CLUSTER", "KEYSLOT", key))
        return self._slot_owner(slot)

    def _slot_owner(self, slot: int) -> int:
        import redis

        live = next(p for i, p in enumerate(self.ports) if self.procs[i] is not None)
        for lo, hi, primary, *_ in redis.Redis(host=HOST, port=live).execute_command(
            "CLUSTER", "SLOTS"
        ):
            if lo <= slot <= hi:
                return self.ports.index(int(primary[1]))
        raise KeyError(slot)

    def keys_per_node(self) -> list[int]:
        """DBSIZE of every node (-1 for a dead one)."""
        sizes = []
        for i, p in enumerate(self.ports):
            if self.procs[i] is None:
                sizes.append(-1)
                continue
            sizes.append(int(_cli(p, "dbsize").strip() or 0))
        return sizes

    def client(self):  # redis-py's cluster client, for poking at stored bytes
        from redis.cluster import ClusterNode
        from redis.cluster import RedisCluster as PyCluster

        return PyCluster(startup_nodes=[ClusterNode(HOST, p) for p in self.ports])


def cluster_available() -> bool:
    """redis-server and redis-cli on PATH and LMCache's cluster client (the `cluster` extra)."""
    import importlib.util

    tools = shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None
    return tools and importlib.util.find_spec("glide_sync") is not None


SKIP_REASON = (
    "needs redis-server/redis-cli (apt-get install -y redis-server) and valkey-glide-sync "
    "(pip install 'himamba[cluster]'); make test installs both"
)


@contextmanager
def running_cluster(workdir: Path) -> Iterator[RedisCluster]:
    """A started 3-node cluster in ``workdir``, stopped on exit; skips the test without one."""
    if not cluster_available():
        pytest.skip(SKIP_REASON)
    cluster = RedisCluster(workdir)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    with running_cluster(tmp_path / "cluster") as cluster:
        yield cluster
