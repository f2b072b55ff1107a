"""The stored object's checksum: cheap enough for reads at I/O speed, still sound.

The checksum is unkeyed (it guards integrity, not forgery), so the cheapest one that catches
corruption wins: xxh3_128 by default. These tests pin what must not change with the algorithm:
corruption anywhere is caught, the algorithm comes from our config (never from the header),
and a process that cannot run the configured one refuses to start, naming the key.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from himamba.tiers import object_format
from himamba.tiers.object_format import HEADER_SIZE, ChecksumAlgo, key_digest, resolve_algo
from himamba.tiers.storage_config import StorageConfig

pytest.importorskip("xxhash")

NS = object_format.Namespace(
    "org/model", object_format.LayoutFingerprint(16, "bfloat16", (4, 2, 16, 2, 64))
)
KEY = object_format.StorageKey(b"\x07" * 32, object_format.ObjectKind.KV)


def sealed(payload: bytes, algo: ChecksumAlgo) -> bytearray:
    buf = bytearray(HEADER_SIZE + len(payload))
    object_format.encode_object(memoryview(buf), memoryview(payload), kind=KEY.kind,
                  layout_digest=NS.digest(), key_dig=key_digest(NS, KEY), algo=algo)  # fmt: skip
    return buf


def check(buf: bytearray, algo: ChecksumAlgo, n: int) -> str | None:
    return object_format.validate_object(memoryview(buf), kind=KEY.kind, payload_nbytes=n,
                           layout_digest=NS.digest(), key_dig=key_digest(NS, KEY), algo=algo)  # fmt: skip


def test_default_checksum_is_xxh3_128_and_resolves_to_its_header_byte():
    cfg = StorageConfig.from_dict({"url": "/x"})
    assert cfg.checksum == "xxh3_128"
    assert resolve_algo(cfg.checksum) is ChecksumAlgo.XXH3_128 == 3


@pytest.mark.parametrize("offset", [0, 1, 4095, 4096, 65535, (1 << 20) - 1])
def test_xxh3_catches_a_single_flipped_bit_anywhere_in_the_payload(offset: int):
    payload = bytes(range(256)) * 4096  # 1 MiB
    buf = sealed(payload, ChecksumAlgo.XXH3_128)
    assert check(buf, ChecksumAlgo.XXH3_128, len(payload)) is None
    buf[HEADER_SIZE + offset] ^= 0x01
    assert check(buf, ChecksumAlgo.XXH3_128, len(payload)) == "checksum"


def test_xxh3_flipped_stored_digest_is_a_checksum_miss():
    buf = sealed(b"x" * 1000, ChecksumAlgo.XXH3_128)
    buf[HEADER_SIZE - 1] ^= 0x01  # the last byte of the stored checksum itself
    assert check(buf, ChecksumAlgo.XXH3_128, 1000) == "checksum"


def test_objects_of_the_previous_default_are_algo_misses_unless_configured():
    """Format version 1 is kept: an object sealed with blake3 (a store written under
    `checksum: blake3`) is readable with `checksum: blake3` and a clean 'algo' miss under xxh3_128, and the
    header's algo byte can never make a reader skip or weaken its own check."""
    payload = b"kv" * 5000
    old = sealed(payload, ChecksumAlgo.BLAKE3)
    assert old[4:6] == (1).to_bytes(2, "little")  # FORMAT_VERSION unchanged
    assert check(old, ChecksumAlgo.BLAKE3, len(payload)) is None
    assert check(old, ChecksumAlgo.XXH3_128, len(payload)) == "algo"
    forged = bytearray(old)
    forged[7] = int(ChecksumAlgo.XXH3_128)  # claims xxh3, keeps blake3's digest
    assert check(forged, ChecksumAlgo.XXH3_128, len(payload)) == "checksum"


def test_missing_checksum_package_is_a_config_error_naming_the_key(monkeypatch):
    real_find, real_import = importlib.util.find_spec, importlib.import_module

    def find(name, *a):
        return None if name == "xxhash" else real_find(name, *a)

    def imp(name, *a):
        if name == "xxhash":
            raise ImportError("No module named 'xxhash'")
        return real_import(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find)
    monkeypatch.setattr(object_format.importlib, "import_module", imp)
    with pytest.raises(ValueError, match=r"^storage\.checksum: 'xxh3_128' needs .*'xxhash'"):
        StorageConfig.from_dict({"url": "/x"})
    with pytest.raises(ValueError, match=r"^storage\.checksum: 'xxh3_128' needs .*'xxhash'"):
        resolve_algo("xxh3_128")
    assert StorageConfig.from_dict({"url": "/x", "checksum": "crc32"}).checksum == "crc32"
    assert resolve_algo("crc32") is ChecksumAlgo.CRC32


def test_unknown_algorithm_name_is_refused_not_replaced():
    with pytest.raises(ValueError, match=r"^storage\.checksum: 'sha1' is not one of"):
        resolve_algo("sha1")
