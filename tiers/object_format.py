"""What a stored object is: its key in LMCache's namespace and its self-describing header.

Storage bytes are untrusted: another model, another layout, a half-copied file, a stale Redis
value or a desynchronised RESP connection (seen with LMCache 0.5.6) all look like "some bytes of
about the right size". The header binds the payload to its key and layout and checksums it, so
any of those becomes a miss instead of a wrong token. No pickle anywhere: the header is `struct`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache

MAGIC = b"HMBS"
FORMAT_VERSION = 1
# <magic 4s><version H><kind B><algo B><payload_size Q><layout 16s><key 16s><checksum 16s>
_HEADER = struct.Struct("<4sHBBQ16s16s16s")
HEADER_SIZE = _HEADER.size  # 64
_CHECKED_PREFIX = HEADER_SIZE - 16  # the checksum covers every header field before it
_DIGEST = 16
# Every reason `validate_object` can return (metrics export each, even at 0).
INVALID_REASONS = ("size", "magic", "version", "kind", "layout", "key", "algo", "checksum")


class ObjectKind(IntEnum):
    """Also LMCache's `object_group_id`, so KV runs and Mamba snapshots never share a key."""

    KV = 0
    MAMBA = 1
    PROBE = 15  # health probes of the circuit breaker; never seen by the connector


# The two kinds the connector moves, as plain ints: step plans and acknowledgements carry them
# between processes.
KV_OBJECT, MAMBA_OBJECT = int(ObjectKind.KV), int(ObjectKind.MAMBA)


class ChecksumAlgo(IntEnum):
    """The header's algo byte. Adding one is not a format change: an object checked with an
    algorithm other than the reader's configured one is an 'algo' miss, never misread."""

    CRC32 = 1
    BLAKE3 = 2
    XXH3_128 = 3


# Config name -> (algorithm, the module that computes it). The config names the algorithm;
# stored bytes never do (see `validate_object`).
CHECKSUM_ALGOS = {
    "xxh3_128": (ChecksumAlgo.XXH3_128, "xxhash"),
    "blake3": (ChecksumAlgo.BLAKE3, "blake3"),
    "crc32": (ChecksumAlgo.CRC32, "zlib"),
}


def _b2(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()


@dataclass(frozen=True)
class LayoutFingerprint:
    """Everything that changes how a block's bytes must be interpreted.

    Two processes agree on a fingerprint only if they can use each other's bytes verbatim; any
    change (block size, dtype, a shape, TP split, kernel layout) moves to a new namespace.
    """

    block_size: int
    kv_dtype: str
    kv_shape: tuple[int, ...]
    mamba_dtypes: tuple[str, ...] = ()
    mamba_shapes: tuple[tuple[int, ...], ...] = ()
    tp_rank: int = 0
    tp_size: int = 1
    kernel_layout: str = ""

    def canonical(self) -> bytes:
        d = {
            "v": FORMAT_VERSION,
            "block_size": int(self.block_size),
            "kv_dtype": str(self.kv_dtype),
            "kv_shape": [int(x) for x in self.kv_shape],
            "mamba_dtypes": [str(x) for x in self.mamba_dtypes],
            "mamba_shapes": [[int(x) for x in s] for s in self.mamba_shapes],
            "tp_rank": int(self.tp_rank),
            "tp_size": int(self.tp_size),
            "kernel_layout": str(self.kernel_layout),
        }
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        return _b2(self.canonical())


_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Namespace:
    """Model + layout: one process's view of which stored bytes are its own."""

    model: str
    layout: LayoutFingerprint

    def digest(self) -> bytes:
        """16 bytes over the full model name and the layout (the readable tag is truncated).
        Computed once: every object's header check needs it (a JSON dump each time cost a
        third of a 1 MiB object's validation)."""
        d = self.__dict__.get("_digest")
        if d is None:
            d = _b2(self.model.encode() + b"\0" + self.layout.canonical())
            object.__setattr__(self, "_digest", d)  # frozen: a cache, not a field
        return d

    def model_tag(self) -> str:
        """LMCache `model_name`: readable, filename-safe, no '@', and unique per namespace."""
        safe = _SAFE.sub("_", self.model).strip("._")[:48] or "model"
        return f"{safe}.{self.digest().hex()[:16]}"

    def kv_rank(self) -> int:
        return ((self.layout.tp_size & 0xFFFF) << 16) | (self.layout.tp_rank & 0xFFFF)


@dataclass(frozen=True)
class StorageKey:
    """Our key: a vLLM block hash, what the object holds, and the request's cache_salt."""

    block_hash: bytes
    kind: ObjectKind
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.block_hash, bytes) or not 1 <= len(self.block_hash) <= 64:
            raise ValueError(f"block_hash must be 1..64 bytes, got {self.block_hash!r}")


@lru_cache(maxsize=1024)
def salt_tag(cache_salt: str) -> str:
    """Salts are hashed: LMCache puts them in filenames (length, charset) and they may be secret.

    Memoized: every storage key carries a salt (the generation's epoch), a process sees a handful
    of distinct ones, and hashing one per key was a third of converting a key for LMCache."""
    return "" if not cache_salt else "s" + _b2(cache_salt.encode())[:8].hex()


def key_digest(ns: Namespace, key: StorageKey) -> bytes:
    """Binds an object to exactly one key: a file copied or renamed onto another key is foreign."""
    return _b2(
        ns.digest() + bytes([int(key.kind)]) + key.block_hash + b"\0" + key.cache_salt.encode()
    )


def key_string(ns: Namespace, key: StorageKey) -> str:
    """Human-readable form (logs, tests); the adapters derive the same fields from ObjectKey."""
    s = f"{ns.model_tag()}@{ns.kv_rank():08x}@{int(key.kind):x}@{key.block_hash.hex()}"
    st = salt_tag(key.cache_salt)
    return f"{s}@{st}" if st else s


def stored_size(payload_nbytes: int) -> int:
    """Bytes one object occupies in storage (what capacity accounting must count)."""
    return HEADER_SIZE + payload_nbytes


def _checksum(algo: ChecksumAlgo, prefix: bytes, payload: memoryview) -> bytes:
    """16 bytes over `prefix` then `payload`, streamed (no concatenating copy)."""
    if algo == ChecksumAlgo.XXH3_128:
        import xxhash  # noqa: PLC0415 (the `storage` extra; checked by `resolve_algo`)

        h = xxhash.xxh3_128(prefix)
        h.update(payload)
        return h.digest()
    if algo == ChecksumAlgo.CRC32:
        return zlib.crc32(payload, zlib.crc32(prefix)).to_bytes(4, "little") + bytes(12)
    import blake3  # noqa: PLC0415

    h3 = blake3.blake3(prefix)
    h3.update(payload)
    return h3.digest(_DIGEST)


def resolve_algo(name: str) -> ChecksumAlgo:
    """The configured algorithm, or a `storage.checksum` error if this process cannot run it.

    No silent fallback: two processes sharing a store with the same config but different
    installed wheels would write objects the other reads as 'algo' misses and deletes."""
    if name not in CHECKSUM_ALGOS:
        raise ValueError(f"storage.checksum: {name!r} is not one of {', '.join(CHECKSUM_ALGOS)}")
    algo, module = CHECKSUM_ALGOS[name]
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ValueError(
            f"storage.checksum: {name!r} needs the Python package {module!r}, which is not "
            "installed (pip install 'himamba[storage]', or choose another checksum)"
        ) from e
    return algo


def seal_object(
    out: memoryview, *, kind: ObjectKind, layout_digest: bytes, key_dig: bytes, algo: ChecksumAlgo
) -> None:
    """Write the header of an object whose payload already sits at `out[HEADER_SIZE:]`.

    The store copies a caller's payload into its staging buffer at submission and seals it
    later on a CPU worker: one copy, and the checksum stays off the caller's thread."""
    if out.nbytes < HEADER_SIZE:
        raise ValueError(f"out is {out.nbytes} bytes, shorter than the {HEADER_SIZE}-byte header")
    n = out.nbytes - HEADER_SIZE
    prefix = _HEADER.pack(
        MAGIC, FORMAT_VERSION, int(kind), int(algo), n, layout_digest, key_dig, bytes(16)
    )[:_CHECKED_PREFIX]
    out[:_CHECKED_PREFIX] = prefix
    out[_CHECKED_PREFIX:HEADER_SIZE] = _checksum(algo, prefix, out[HEADER_SIZE:])


def encode_object(
    out: memoryview,
    payload: memoryview,
    *,
    kind: ObjectKind,
    layout_digest: bytes,
    key_dig: bytes,
    algo: ChecksumAlgo,
) -> None:
    """Write header + payload into `out` (exactly `stored_size(len(payload))` bytes)."""
    n = payload.nbytes
    if out.nbytes != HEADER_SIZE + n:
        raise ValueError(f"out is {out.nbytes} bytes, need {HEADER_SIZE + n}")
    out[HEADER_SIZE:] = payload
    seal_object(out, kind=kind, layout_digest=layout_digest, key_dig=key_dig, algo=algo)


def validate_object(
    obj: memoryview,
    *,
    kind: ObjectKind,
    payload_nbytes: int,
    layout_digest: bytes,
    key_dig: bytes,
    algo: ChecksumAlgo,
) -> str | None:
    """None if `obj` is a valid object for this key, else the reason (a counter label).

    `algo` is the reader's configured algorithm, never the header's: the header is as
    untrusted as the payload, and trusting its choice would let stored bytes pick the check
    they must pass (a 32-bit crc32) or name one this process cannot run. Another algorithm:
    'algo'. The checksums are unkeyed: they catch corruption (torn, truncated, bit-flipped or
    desynchronised bytes), not forgery - whoever can write the store can recompute them."""
    if obj.nbytes != HEADER_SIZE + payload_nbytes:
        return "size"
    magic, version, k, a, n, layout, kd, csum = _HEADER.unpack(obj[:HEADER_SIZE])
    if magic != MAGIC:
        return "magic"
    if version != FORMAT_VERSION:
        return "version"
    if n != payload_nbytes:
        return "size"
    if k != int(kind):
        return "kind"
    if layout != layout_digest:
        return "layout"
    if kd != key_dig:
        return "key"
    if a != int(algo):
        return "algo"
    if _checksum(algo, bytes(obj[:_CHECKED_PREFIX]), obj[HEADER_SIZE:]) != csum:
        return "checksum"
    return None
