"""`redis+cluster://` and `valkey+cluster://` URLs -> LMCache's `valkey` L2 adapter in cluster mode.

Why a separate scheme: LMCache's `resp` adapter (what `redis://` maps to) speaks to one server
and does not follow a cluster's MOVED/ASK redirects, so pointing it at a cluster node silently
loses every key that hashes elsewhere. The `valkey` adapter runs on Valkey GLIDE's cluster
client, which learns the slot map from any seed node and follows redirects and failovers.

    redis+cluster://[user[:password]@]host1[:port1][,host2[:port2]...][/]
    valkey+cluster://...                       (same thing)
    rediss+cluster://... / valkeys+cluster://  (TLS)

The seeds are only where discovery starts: one reachable node is enough. Kept free of LMCache
and GLIDE imports (the scheduler parses config before any heavy module loads); the client
package is only looked up, so a missing `himamba[cluster]` extra fails at start-up with an
error that names it. Passwords never appear in an error: messages quote the URL redacted.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from .config_fields import installed
from .redaction import redacted_url

CLUSTER_SCHEMES = {
    "redis+cluster": False,  # scheme -> TLS
    "valkey+cluster": False,
    "rediss+cluster": True,
    "valkeys+cluster": True,
}
CLUSTER_EXTRA = "pip install 'himamba[cluster]'"
DEFAULT_PORT = 6379
# The Python package LMCache's `valkey` adapter imports (PyPI: valkey-glide-sync).
GLIDE_MODULE = "glide_sync"


def is_cluster_url(url: object) -> bool:
    """Whether `url` names a Redis/Valkey Cluster (one of `CLUSTER_SCHEMES`)."""
    if not isinstance(url, str):
        return False
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.lower() in CLUSTER_SCHEMES


def _err(msg: str) -> ValueError:
    return ValueError(f"storage.url: {msg}")


def _parse_node(chunk: str, shown: str) -> str:
    """One `host[:port]` or `[v6]:port` seed -> LMCache's `host:port` (it splits at the last
    colon, so a bare IPv6 address comes out right)."""
    if chunk.startswith("["):
        host, close, tail = chunk[1:].partition("]")
        if not close or not host or (tail and not tail.startswith(":")):
            raise _err(f"bad IPv6 node {chunk!r} in {shown!r}")
        port_str = tail[1:]
    else:
        host, _, port_str = chunk.partition(":")
        if ":" in port_str:
            raise _err(f"IPv6 node {chunk!r} needs brackets ([addr]:port) in {shown!r}")
    if not host:
        raise _err(f"node {chunk!r} has no host in {shown!r}")
    if not port_str:
        return f"{host}:{DEFAULT_PORT}"
    if not port_str.isdigit() or not 0 < int(port_str) < 65536:
        raise _err(f"bad port in node {chunk!r} of {shown!r}")
    return f"{host}:{int(port_str)}"


def cluster_adapter_spec(
    url: str, num_workers: int = 4, require_client: bool = True
) -> dict[str, Any]:
    """The LMCache `valkey` adapter spec (cluster mode) for a cluster URL.

    Raises `ValueError('storage.url: ...')` with the URL's password hidden, and, unless
    `require_client` is False, one naming the `himamba[cluster]` extra when GLIDE is missing.
    """
    shown = redacted_url(url)
    scheme, sep, rest = url.partition("://")
    tls = CLUSTER_SCHEMES.get(scheme.lower())
    if not sep or tls is None:
        raise _err(f"not a cluster URL ({', '.join(CLUSTER_SCHEMES)}): {shown!r}")
    for bad, what in (("?", "query parameters"), ("#", "a fragment")):
        if bad in rest.rpartition("@")[2]:
            raise _err(f"{what} unsupported in a cluster URL: {shown!r}")
    userinfo, at, hosts = rest.rpartition("@")
    hosts, slash, path = hosts.partition("/")
    if slash and path not in ("", "0"):
        # A cluster has only database 0 (SELECT is refused in cluster mode).
        raise _err(f"a cluster has only database 0, got {path!r} in {shown!r}")
    chunks = [c.strip() for c in hosts.split(",")]
    if not hosts or any(not c for c in chunks):
        raise _err(f"cluster URL needs host[:port] seeds separated by commas, got {shown!r}")
    nodes = list(dict.fromkeys(_parse_node(c, shown) for c in chunks))
    spec: dict[str, Any] = {
        "type": "valkey",
        "startup_nodes": ",".join(nodes),
        "cluster_mode": True,
        "num_workers": num_workers,
    }
    if tls:
        spec["tls_enable"] = True
    if at:
        if any(c in userinfo for c in "/?#"):
            # Every URL parser (ours, the redaction in logs) must agree where the hosts start.
            raise _err(f"percent-encode '/', '?' and '#' in the user or password of {shown!r}")
        user, colon, password = userinfo.partition(":")
        if user:
            spec["username"] = unquote(user)
        if colon and password:
            spec["password"] = unquote(password)
        elif colon:
            raise _err(f"empty password in {shown!r} (drop the ':' or give one)")
    if require_client:
        require_cluster_client()
    return spec


def require_cluster_client() -> None:
    """Fail at start-up, naming the extra, when LMCache's `valkey` adapter cannot import its
    client: otherwise the breaker would report storage "down" forever for a packaging error."""
    if not installed(GLIDE_MODULE):
        raise _err(
            "a Redis/Valkey Cluster URL needs the Valkey GLIDE client (PyPI valkey-glide-sync), "
            f"which is not installed: {CLUSTER_EXTRA}"
        )
