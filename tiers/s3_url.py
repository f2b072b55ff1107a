"""`s3://` URLs -> LMCache's `s3` L2 adapter: an object store as the fleet's cold tier.

    s3://BUCKET?region=REGION                                  (AWS S3, TLS)
    s3://BUCKET?region=REGION&endpoint=http://HOST:PORT        (an S3-compatible store)

LMCache's adapter addresses a bucket only virtual-hosted style (the bucket is part of the host
name its requests are signed for), so the URL names the bucket and, for an S3-compatible
store, the service's endpoint; this module builds the `BUCKET.HOST[:PORT]` endpoint the adapter
wants. `http://` endpoints run without TLS. The region may instead come from `AWS_REGION` or
`AWS_DEFAULT_REGION`.

Credentials never go in the URL (it is logged and shown by the status endpoint): the adapter
resolves them through boto3's usual chain (environment, shared profile, container or instance
role), so the `himamba[s3]` extra brings boto3 and a missing one fails at start-up naming the
extra. The adapter writes at the bucket's root, so a key prefix (`s3://bucket/prefix`) is an
error rather than silently ignored: give each fleet and model family a bucket of its own, or
rely on the key namespace (model, layout, salt), which keeps different models apart anyway.

Kept free of LMCache and boto3 imports: the scheduler parses its config before any heavy module
loads.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .config_fields import installed

S3_EXTRA = "pip install 'himamba[s3]'"
# Bucket names S3 accepts for virtual-hosted addressing (lowercase DNS labels, 3-63 chars).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PARAMS = ("region", "endpoint", "io_threads")


def is_s3_url(url: object) -> bool:
    return isinstance(url, str) and url.lower().startswith("s3://")


def _err(msg: str) -> ValueError:
    return ValueError(f"storage.url: {msg}")


def _one(params: dict[str, list[str]], name: str) -> str | None:
    values = params.get(name)
    if not values:
        return None
    if len(values) > 1 or not values[0]:
        raise _err(f"give {name}= once, with a value")
    return values[0]


def s3_adapter_spec(url: str, num_workers: int = 4, require_client: bool = True) -> dict[str, Any]:
    """The LMCache `s3` adapter spec for an `s3://` URL (see the module docstring)."""
    parts = urlsplit(url)
    bucket = parts.netloc
    if "@" in bucket:  # never echoed: it may hold a secret
        raise _err(
            "credentials do not belong in the URL; set AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY, a profile or a role (boto3's usual chain)"
        )
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise _err(f"bad bucket name {bucket!r} in s3://BUCKET (a lowercase DNS name, 3-63 chars)")
    if parts.path not in ("", "/"):
        raise _err(
            f"key prefixes are unsupported (LMCache's s3 adapter writes at the bucket root): "
            f"got path {parts.path!r}; use a bucket of its own"
        )
    if parts.fragment:
        raise _err("a fragment is unsupported in an s3 URL")
    params = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(params) - set(_PARAMS))
    if unknown:
        raise _err(f"unknown s3 URL parameter(s) {', '.join(unknown)}; known: {', '.join(_PARAMS)}")
    region = (
        _one(params, "region")
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
    )
    if not region:
        raise _err("an s3 URL needs ?region=... (or AWS_REGION in the environment)")
    threads = _one(params, "io_threads")
    if threads is not None and (not threads.isdigit() or int(threads) < 1):
        raise _err(f"io_threads must be a positive integer, got {threads!r}")
    endpoint = _one(params, "endpoint")
    tls = True
    if endpoint is None:
        host = f"s3.{region}.amazonaws.com"
    else:
        ep = urlsplit(endpoint)
        if "@" in ep.netloc:  # never echoed: it may hold a secret
            raise _err("credentials do not belong in the endpoint either (boto3's chain)")
        if ep.scheme not in ("http", "https") or not ep.hostname:
            raise _err(f"endpoint must be http://HOST[:PORT] or https://..., got {endpoint!r}")
        if ep.path not in ("", "/") or ep.query:
            raise _err(f"endpoint takes only a scheme, host and port, got {endpoint!r}")
        try:
            port = ep.port
        except ValueError as e:
            raise _err(f"bad port in endpoint {endpoint!r}") from e
        host = ep.hostname if port is None else f"{ep.hostname}:{port}"
        tls = ep.scheme == "https"
    spec: dict[str, Any] = {
        "type": "s3",
        "s3_endpoint": f"{bucket}.{host}",
        "s3_region": region,
        # The adapter's default is 64 CRT threads; the store's own workers bound its concurrency.
        "s3_num_io_threads": int(threads) if threads else max(num_workers, 2),
        "disable_tls": not tls,
    }
    if require_client:
        require_s3_client()
    return spec


def require_s3_client() -> None:
    """Fail at start-up, naming the extra, when boto3 (the adapter's credential chain) or
    awscrt (its client) is missing, instead of a store that is "down" forever."""
    for module in ("boto3", "awscrt"):
        if not installed(module):
            raise _err(f"an s3 URL needs the {module} package, which is not installed: {S3_EXTRA}")
