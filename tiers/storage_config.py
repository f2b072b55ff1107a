"""Configuration of the storage (LMCache L2) tier.

Kept free of LMCache and torch imports: the scheduler parses this before any heavy module loads,
and a typo must fail at startup with a message that names the key, not deep inside an adapter.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any
from urllib.parse import unquote, urlsplit

from .cluster_url import cluster_adapter_spec, is_cluster_url
from .config_fields import installed, number
from .object_format import CHECKSUM_ALGOS  # struct/hashlib only: no LMCache, no torch
from .redaction import REDACTED, SECRET_KEYS, redacted_url
from .s3_url import is_s3_url, s3_adapter_spec

CHECKSUMS = tuple(CHECKSUM_ALGOS)
WEIGHTS_FINGERPRINTS = ("sampled", "full")


class WritePolicy(str, Enum):
    """When host objects reach storage. Each decision a policy makes is one property here, so
    no caller compares policy names."""

    WRITE_THROUGH = "write_through"  # every object the CPU tier stores, once copied
    SELECTIVE = "write_through_selective"  # objects loads used `write_threshold` times
    WRITE_BACK = "write_back"  # objects the CPU tier evicts, and all at clean shutdown
    NONE = "none"  # read only

    @property
    def writes_every_store(self) -> bool:
        return self is WritePolicy.WRITE_THROUGH

    @property
    def writes_popular(self) -> bool:
        return self is WritePolicy.SELECTIVE

    @property
    def writes_evictions(self) -> bool:
        return self is WritePolicy.WRITE_BACK


class PrefetchPolicy(str, Enum):
    """How long a request may wait for storage."""

    BEST_EFFORT = "best_effort"  # never: what arrived is used, the rest warms later requests
    WAIT_COMPLETE = "wait_complete"  # for the probe and the fetch (each op has its deadline)
    TIMEOUT = "timeout"  # at most the linear deadline of `prefetch_timeout_*`


PREFETCH_POLICIES = tuple(p.value for p in PrefetchPolicy)
WRITE_POLICIES = tuple(p.value for p in WritePolicy)

_PREFIX = "storage"


def _err(key: str, msg: str) -> ValueError:
    return ValueError(f"{_PREFIX}.{key}: {msg}")


# Adapter spec keys whose values are secrets (Redis AUTH, cloud credentials): never shown.
def redacted_adapter(spec: Mapping[str, Any]) -> dict[str, Any]:
    """An adapter spec with every secret-looking value replaced by ``***``."""
    return {
        k: REDACTED if any(s in str(k).lower() for s in SECRET_KEYS) and v else v
        for k, v in spec.items()
    }


@dataclass(frozen=True, repr=False)
class StorageConfig:
    """Every tunable of the storage tier, with its default and why.

    `adapter` is the resolved LMCache L2 adapter spec (the JSON LMCache's own `--l2-adapter`
    takes); `url` is kept only for messages and for the `fs_native` -> `fs` fallback.
    """

    # Resolved LMCache L2 adapter spec; `type` selects the adapter module.
    adapter: dict[str, Any] = field(default_factory=dict)
    # What the user wrote, if a URL: error messages and the fs fallback refer to it.
    url: str | None = None
    # None = unbounded; else the tree evicts storage objects by LRU above this many GiB.
    capacity_gb: float | None = None
    # When host objects reach storage (the reference's write policies):
    #   write_through: every completed CPU store (a restart or a second instance finds all);
    #   write_through_selective: an object once matches reached it `write_threshold` times
    #     (storage traffic only for prefixes that proved popular);
    #   write_back: an object when the CPU tier evicts it, and everything at clean shutdown
    #     (least traffic; a crash loses what was only on the host);
    #   none: never (a reader that only uses what others stored).
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    # Matches that make an object worth writing under write_through_selective (reference: 2).
    write_threshold: int = 2
    # `timeout` is the only policy that both waits for storage and bounds the wait.
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT
    # Reference (SGLang HiCache) defaults: a fixed 2 s plus 0.1 s per 1024 tokens, capped at 30 s.
    prefetch_timeout_base_s: float = 2.0
    prefetch_timeout_per_ki_token_s: float = 0.1
    prefetch_timeout_max_s: float = 30.0
    # Storage is asked (probe, then fetch) only for a hit that adds at least this many tokens
    # beyond what the device and the host already hold: a few blocks can recompute faster
    # than a storage round trip and two engine steps. 0 (any gain) by default, as before;
    # the reference's is 256, which a fleet on one store may want (docs/BENCHMARKS.md).
    prefetch_threshold_tokens: int = 0
    # Adapters have no timeouts of their own (a dead Redis hangs a load forever): ours bounds each.
    op_deadline_s: float = 5.0
    # Consecutive failed ops before the breaker opens; small because every failure costs a deadline.
    breaker_failures: int = 3
    # Wait before recreating the adapter and probing again: avoids reconnect storms.
    breaker_cooldown_s: float = 2.0
    # Each re-open without a healthy period (this long closed) doubles the cool-down, up to
    # this: flapping or slow-but-alive storage then costs waiting requests ever more rarely.
    breaker_max_cooldown_s: float = 60.0
    # Health probe period: the native Redis adapter reports misses, not errors, once its server restarts.
    probe_interval_s: float = 5.0
    # CPU threads for header+checksum work; checksums release the GIL, so 2 saturate a small VM.
    num_workers: int = 2
    # Adapter I/O threads (fs_native / resp from a url): they wait on disk or network, not CPU.
    io_workers: int = 4
    # Unkeyed integrity check of every object (it catches corruption, not forgery: whoever can
    # write the store can recompute any of these). xxh3_128 runs at ~30 GB/s per core, so
    # reads stay at I/O speed; blake3 (~4.5 GB/s per core here) keeps stores sealed with it
    # readable; crc32 (~4 GB/s, 32 bits) is the weakest.
    checksum: str = "xxh3_128"
    # Staging buffers kept for reuse: first-touch page faults cost more than the copy itself.
    staging_pool_mb: int = 256
    # Bound on put bytes held at once (queued, with the adapter, or kept for a hung adapter):
    # each put is copied into store memory at submission, so without a bound a slow or stalled
    # backend grows it without limit. A put that does not fit is dropped ("backpressure"):
    # write-through is best effort, a skipped put only costs a future storage hit. 256 MiB
    # absorbs ~0.5 s of writes at the ~0.5 GB/s a local fs adapter sustains.
    write_buffer_mb: int = 256
    # Put batches handed to the adapter at once; the rest wait in the store's queue (bounded by
    # write_buffer_mb). The op deadline runs from the hand-off, so it times the backend, not a
    # burst queued inside the adapter, and gets are not stuck behind that burst.
    adapter_put_depth: int = 4
    # Niceness of the store's own threads (its driver, checksum and delete workers; Linux):
    # storage work is background work and must not take CPU from the engine on a busy host.
    # 0 = same priority as vLLM (the connector opens the scheduler's probe store with 0).
    thread_nice: int = 10
    # Per engine step, the scheduler may block this long in total for storage probe answers:
    # probes are sent when a request arrives, so most answers are back by its first lookup and
    # a cold request is scheduled in its first step instead of paying an extra one.
    probe_wait_ms: float = 5.0
    # The operator's own identity of the served weights (e.g. a training step); replaces the
    # checkpoint fingerprint in storage namespaces. None = fingerprint the checkpoint files.
    weights_id: str | None = None
    # How checkpoint files are fingerprinted: "sampled" (header + start/middle/end of every
    # tensor; milliseconds) or "full" (every byte; for checkpoints edited in place in a few rows).
    weights_fingerprint: str = "sampled"
    # Environment variable holding the store's password (Redis AUTH): vLLM logs the whole
    # kv_connector_extra_config at start-up, so a secret written there ends up in its log.
    password_env: str | None = None

    @property
    def target(self) -> str:
        """The store, for logs and status answers: its URL, or its adapter spec, secrets
        hidden."""
        if self.url is not None:
            return str(redacted_url(self.url))
        return json.dumps(redacted_adapter(self.adapter), sort_keys=True, default=str)

    def identity(self) -> str:
        """Equal for equal configurations, secrets included but digested (never shown): lets
        a worker tell whether the scheduler half runs on the store it runs on."""
        every = {f.name: getattr(self, f.name) for f in fields(self)}
        text = json.dumps(every, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["url"] = redacted_url(self.url)
        shown["adapter"] = redacted_adapter(self.adapter)
        return f"StorageConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StorageConfig:
        """Parse the user's `storage` section; raise `ValueError('storage.<key>: ...')`."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{_PREFIX}: expected a mapping, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__) | {"write_through"}  # boolean policy shorthand
        for k in d:
            if k not in known:
                raise _err(str(k), "unknown key")
        kw: dict[str, Any] = {}
        num_workers = _int(d, "num_workers", cls.num_workers, minimum=1)
        io_workers = _int(d, "io_workers", cls.io_workers, minimum=1)
        url, adapter = d.get("url"), d.get("adapter")
        if url is not None and adapter is not None:
            raise _err("adapter", "give either 'url' or 'adapter', not both")
        if url is None and adapter is None:
            raise _err("url", "required (or give 'adapter')")
        if url is not None:
            kw["url"] = url
            kw["adapter"] = adapter_spec_from_url(url, io_workers)
        else:
            kw["adapter"] = _adapter_passthrough(adapter)
        if d.get("password_env") is not None:
            kw["password_env"], kw["adapter"] = _password_from_env(d["password_env"], kw["adapter"])
        cap = d.get("capacity_gb")
        if cap is not None:
            kw["capacity_gb"] = _float(d, "capacity_gb", 0.0, positive=True)
        policy = d.get("write_policy", cls.write_policy)
        if "write_through" in d:  # shorthand: true = write_through, false = none
            if not isinstance(d["write_through"], bool):
                raise _err("write_through", f"expected true/false, got {d['write_through']!r}")
            if "write_policy" in d:
                raise _err("write_through", "give either 'write_through' or 'write_policy'")
            policy = "write_through" if d["write_through"] else "none"
        if policy not in WRITE_POLICIES:
            raise _err("write_policy", f"{policy!r} is not one of {', '.join(WRITE_POLICIES)}")
        kw["write_policy"] = WritePolicy(policy)
        kw["write_threshold"] = _int(d, "write_threshold", cls.write_threshold, minimum=1)
        kw["prefetch_threshold_tokens"] = _int(
            d, "prefetch_threshold_tokens", cls.prefetch_threshold_tokens, minimum=0
        )
        policy = d.get("prefetch_policy", cls.prefetch_policy)
        if policy not in PREFETCH_POLICIES:
            raise _err(
                "prefetch_policy", f"{policy!r} is not one of {', '.join(PREFETCH_POLICIES)}"
            )
        kw["prefetch_policy"] = PrefetchPolicy(policy)
        for name in (
            "prefetch_timeout_base_s",
            "prefetch_timeout_per_ki_token_s",
            "prefetch_timeout_max_s",
        ):
            kw[name] = _float(d, name, getattr(cls, name))
        for name in (
            "op_deadline_s",
            "breaker_cooldown_s",
            "breaker_max_cooldown_s",
            "probe_interval_s",
        ):
            kw[name] = _float(d, name, getattr(cls, name), positive=True)
        if "breaker_max_cooldown_s" not in d:  # a long base cool-down raises the default cap
            kw["breaker_max_cooldown_s"] = max(
                kw["breaker_max_cooldown_s"], kw["breaker_cooldown_s"]
            )
        elif kw["breaker_max_cooldown_s"] < kw["breaker_cooldown_s"]:
            raise _err("breaker_max_cooldown_s", "must be >= breaker_cooldown_s")
        if kw["prefetch_timeout_max_s"] < kw["prefetch_timeout_base_s"]:
            raise _err("prefetch_timeout_max_s", "must be >= prefetch_timeout_base_s")
        kw["breaker_failures"] = _int(d, "breaker_failures", cls.breaker_failures, minimum=1)
        kw["num_workers"] = num_workers
        kw["io_workers"] = io_workers
        kw["staging_pool_mb"] = _int(d, "staging_pool_mb", cls.staging_pool_mb, minimum=0)
        kw["write_buffer_mb"] = _int(d, "write_buffer_mb", cls.write_buffer_mb, minimum=1)
        kw["adapter_put_depth"] = _int(d, "adapter_put_depth", cls.adapter_put_depth, minimum=1)
        kw["checksum"] = _checksum(d.get("checksum", cls.checksum))
        kw["probe_wait_ms"] = _float(d, "probe_wait_ms", cls.probe_wait_ms)
        kw["thread_nice"] = _int(d, "thread_nice", cls.thread_nice, minimum=0)
        if kw["thread_nice"] > 19:
            raise _err("thread_nice", f"must be <= 19, got {kw['thread_nice']}")
        weights_id = d.get("weights_id")
        if weights_id is not None and (not isinstance(weights_id, str) or not weights_id):
            raise _err("weights_id", f"expected a non-empty string, got {weights_id!r}")
        kw["weights_id"] = weights_id
        mode = d.get("weights_fingerprint", cls.weights_fingerprint)
        if mode not in WEIGHTS_FINGERPRINTS:
            raise _err(
                "weights_fingerprint", f"{mode!r} is not one of {', '.join(WEIGHTS_FINGERPRINTS)}"
            )
        kw["weights_fingerprint"] = mode
        return cls(**kw)


def prefetch_deadline_s(cfg: StorageConfig, num_tokens: int) -> float:
    """Seconds a prefetch of `num_tokens` may keep a request waiting (the reference's linear rule).

    `best_effort` never waits (0.0): whatever already arrived is used. `wait_complete` waits
    without a prefetch bound (inf); each storage op still fails at `op_deadline_s`, so it ends.
    """
    if cfg.prefetch_policy is PrefetchPolicy.BEST_EFFORT:
        return 0.0
    if cfg.prefetch_policy is PrefetchPolicy.WAIT_COMPLETE:
        return math.inf
    linear = cfg.prefetch_timeout_base_s + cfg.prefetch_timeout_per_ki_token_s * num_tokens / 1024
    return min(cfg.prefetch_timeout_max_s, linear)


def adapter_spec_from_url(url: Any, num_workers: int = 4) -> dict[str, Any]:
    """`file:///p` or `/p` -> fs_native spec; `redis://[user:pass@]host[:port][/0]` -> resp spec;
    `redis+cluster://` / `valkey+cluster://` seed lists -> the valkey adapter in cluster mode;
    `s3://bucket?region=...[&endpoint=...]` -> the s3 adapter (``s3_url``)."""
    if not isinstance(url, str) or not url:
        raise _err("url", f"expected a non-empty string, got {url!r}")
    if url.startswith("/"):
        return _fs_spec(url, num_workers)
    if is_cluster_url(url):  # before urlsplit: a seed list has no single port
        return cluster_adapter_spec(url, num_workers)
    if is_s3_url(url):
        return s3_adapter_spec(url, num_workers)
    shown = redacted_url(url)  # errors must not echo a password
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise _err("url", f"file URL must be file:///absolute/path, got {shown!r}")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise _err("url", f"file URL needs an absolute path, got {shown!r}")
        return _fs_spec(path, num_workers)
    if scheme == "redis":
        if not parts.hostname:
            raise _err("url", f"redis URL needs a host, got {shown!r}")
        try:
            port = parts.port or 6379
        except ValueError as e:
            raise _err("url", f"bad port in {shown!r}") from e
        db = parts.path.strip("/")
        if db not in ("", "0"):
            # LMCache's native RESP client never sends SELECT: db N would silently be db 0.
            raise _err("url", f"redis database {db!r} unsupported by LMCache's resp adapter; use 0")
        spec: dict[str, Any] = {
            "type": "resp",
            "host": parts.hostname,
            "port": port,
            "num_workers": num_workers,
        }
        if parts.username:
            spec["username"] = unquote(parts.username)
        if parts.password:
            spec["password"] = unquote(parts.password)
        return spec
    raise _err("url", f"unsupported scheme {parts.scheme or shown!r}")


def _password_from_env(name: Any, adapter: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The adapter spec with its password read from environment variable ``name``."""
    if not isinstance(name, str) or not name:
        raise _err("password_env", f"expected an environment variable name, got {name!r}")
    if adapter.get("type") in ("fs", "fs_native"):
        raise _err("password_env", "a file store takes no password")
    if adapter.get("password"):
        raise _err("password_env", "the url or adapter already carries a password; give it once")
    value = os.environ.get(name)
    if not value:
        raise _err("password_env", f"environment variable {name} is not set (or is empty)")
    return name, {**adapter, "password": value}


def _fs_spec(path: str, num_workers: int) -> dict[str, Any]:
    path = os.path.normpath(path)
    return {
        "type": "fs_native",
        "base_path": path,
        "num_workers": num_workers,
        "relative_tmp_dir": "tmp",  # tmp -> rename: readers never see half-written files
    }


def _adapter_passthrough(adapter: Any) -> dict[str, Any]:
    if isinstance(adapter, str):
        try:
            adapter = json.loads(adapter)
        except json.JSONDecodeError as e:
            raise _err("adapter", f"not valid JSON: {e.msg}") from e
    if not isinstance(adapter, Mapping):
        raise _err("adapter", f"expected an LMCache L2 adapter JSON object, got {adapter!r}")
    t = adapter.get("type")
    if not isinstance(t, str) or not t:
        raise _err("adapter.type", "required (an LMCache L2 adapter type such as 's3')")
    return dict(adapter)


def _checksum(name: Any) -> str:
    if name not in CHECKSUMS:
        raise _err("checksum", f"{name!r} is not one of {', '.join(CHECKSUMS)}")
    module = CHECKSUM_ALGOS[name][1]
    if not installed(module):
        raise _err(
            "checksum",
            f"{name!r} needs the Python package {module!r}, which is not installed "
            "(pip install 'himamba[storage]', or choose another checksum)",
        )
    return name


def _float(d: Mapping[str, Any], key: str, default: float, positive: bool = False) -> float:
    return float(number(f"{_PREFIX}.", key, d.get(key, default), minimum=0, positive=positive))


def _int(d: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    return int(number(f"{_PREFIX}.", key, d.get(key, default), whole=True, minimum=minimum))
