"""Identity of the model *weights*, for storage namespaces: same weights share, others never do.

A stored prefix is a function of the token ids and the weights that computed it. The model's path
says neither: a new checkpoint written to the same path must not read the old objects, and the
same checkpoint mounted at another path should share them. So the identity is derived from the
checkpoint's bytes (plus what changes the computation on load: dtype, quantization, overrides).

Hashing every byte of a large checkpoint costs seconds per process, so the default fingerprint
samples each safetensors tensor at its start, middle and end (a retrained tensor changes nearly
everywhere, so any retrained tensor changes the fingerprint) and hashes the full header (names,
dtypes, shapes, offsets) and config.json. ``full`` hashes every byte; ``weights_id`` in the config
replaces all of it with the operator's own version string (e.g. a training step).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from himamba.tiers.storage_config import WEIGHTS_FINGERPRINTS

if TYPE_CHECKING:
    from vllm.config import LoadConfig, ModelConfig, VllmConfig

logger = logging.getLogger(__name__)

_SAMPLE = 512  # bytes read at each sampled point of a tensor
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
_CHUNK = 8 << 20


def _h() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=16)


def _safetensors_samples(f: int, size: int, h: hashlib.blake2b, full: bool) -> None:
    (n,) = struct.unpack("<Q", os.pread(f, 8, 0))
    if n > size - 8 or n > 100 << 20:
        raise ValueError("not a safetensors file (header length out of range)")
    header = os.pread(f, n, 8)
    h.update(header)
    if full:
        _whole_file(f, size, h, start=8 + n)
        return
    base = 8 + n
    entries = json.loads(header)
    for name in sorted(k for k in entries if k != "__metadata__"):
        begin, end = entries[name]["data_offsets"]
        length = end - begin
        if length <= 3 * _SAMPLE:
            h.update(os.pread(f, length, base + begin))
            continue
        for at in (begin, begin + length // 2 - _SAMPLE // 2, end - _SAMPLE):
            h.update(os.pread(f, _SAMPLE, base + at))


def _spread_samples(f: int, size: int, h: hashlib.blake2b) -> None:
    """Formats we cannot parse (pickled .bin, gguf): 64 evenly spaced samples plus the size."""
    h.update(size.to_bytes(8, "little"))
    points = 64
    for k in range(points):
        h.update(
            os.pread(f, _SAMPLE, (size - _SAMPLE) * k // (points - 1) if size > _SAMPLE else 0)
        )


def _whole_file(f: int, size: int, h: hashlib.blake2b, start: int = 0) -> None:
    pos = start
    while pos < size:
        chunk = os.pread(f, min(_CHUNK, size - pos), pos)
        if not chunk:
            break
        h.update(chunk)
        pos += len(chunk)


def _weight_files(root: Path) -> Iterator[Path]:
    for p in sorted(root.rglob("*")):
        # Skip tool caches inside the checkpoint folder (e.g. huggingface_hub's .cache/).
        if (
            p.is_file()
            and p.suffix in _WEIGHT_SUFFIXES
            and ".cache" not in p.relative_to(root).parts
        ):
            yield p


def fingerprint_checkpoint(root: Path, mode: str = "sampled") -> str:
    """Hex digest of the weight files below ``root`` (their relative paths do not matter)."""
    if mode not in WEIGHTS_FINGERPRINTS:
        raise ValueError(f"weights_fingerprint must be one of {WEIGHTS_FINGERPRINTS}, got {mode!r}")
    h = _h()
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    found = 0
    for path in _weight_files(root):
        fh = _h()
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if path.suffix == ".safetensors":
                _safetensors_samples(fd, size, fh, full=mode == "full")
            elif mode == "full":
                _whole_file(fd, size, fh)
            else:
                _spread_samples(fd, size, fh)
        finally:
            os.close(fd)
        # Sorted digests, not names: the same weights under other file names are the same weights.
        h.update(fh.digest())
        found += 1
    if not found:
        raise FileNotFoundError(f"no weight files under {root}")
    return h.hexdigest()


def _local_checkpoint(model_config: ModelConfig, load_config: LoadConfig | None) -> Path | None:
    name = getattr(model_config, "model_weights", "") or model_config.model
    download_dir = getattr(load_config, "download_dir", None)
    if os.path.isdir(name):
        return Path(name)
    try:  # a hub id vLLM already downloaded: the snapshot folder of that revision
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            name,
            revision=getattr(model_config, "revision", None),
            cache_dir=download_dir,
            local_files_only=True,
        )
        return Path(path)
    except Exception:  # noqa: BLE001 - not cached locally, or not a hub id
        return None


def weights_identity(
    vllm_config: VllmConfig, mode: str = "sampled", weights_id: str | None = None
) -> str:
    """``<Architecture>:<digest>``: equal exactly when the served weights are the same."""
    mc = vllm_config.model_config
    load = getattr(vllm_config, "load_config", None)
    hf = getattr(mc, "hf_config", None)
    arch = ((getattr(hf, "architectures", None) or ["model"]) or ["model"])[0]
    computation = {
        "dtype": str(getattr(mc, "dtype", "")),
        "quantization": str(getattr(mc, "quantization", None)),
        "hf_overrides": repr(getattr(mc, "hf_overrides", None) or {}),
    }
    load_format = str(getattr(load, "load_format", "auto"))
    if weights_id is not None:
        source = f"id:{weights_id}"
    elif load_format == "dummy":
        # vLLM fills dummy weights from a fixed seed: the config and the seed decide them.
        source = f"dummy:{getattr(mc, 'seed', 0)}:{json.dumps(hf.to_dict() if hf else {}, sort_keys=True, default=str)}"
    else:
        root = _local_checkpoint(mc, load)
        if root is None:
            logger.warning(
                "himamba: cannot read the weights of %s to fingerprint them; storage objects are "
                "keyed by its name and revision only (set storage.weights_id to be exact)",
                mc.model,
            )
            source = f"name:{mc.model}@{getattr(mc, 'revision', None)}"
        else:
            source = "files:" + fingerprint_checkpoint(root, mode)
    h = _h()
    h.update(json.dumps(computation, sort_keys=True).encode())
    h.update(source.encode())
    return f"{arch}:{h.hexdigest()}"
