"""Storage namespaces follow the weights, not the path: same checkpoint anywhere shares, a new
checkpoint at the same path (or the same one quantized differently) never reads old objects."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from himamba.connector.weights_identity import fingerprint_checkpoint, weights_identity


def write_safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    header, offset, blob = {}, 0, b""
    for name, data in tensors.items():
        header[name] = {
            "dtype": "U8",
            "shape": [len(data)],
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blob += data
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob)


def checkpoint(root: Path, tweak: int | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["TinyHybrid"]}))
    big = bytearray(range(256)) * 64  # 16 KiB tensor
    if tweak is not None:
        big[tweak] ^= 1
    write_safetensors(root / "model.safetensors", {"a.weight": bytes(big), "b.bias": b"\x01\x02"})
    return root


def vllm_config(
    model: Path, quantization: str | None = None, load_format: str = "auto"
) -> SimpleNamespace:
    hf = SimpleNamespace(
        architectures=["TinyHybrid"], to_dict=lambda: {"architectures": ["TinyHybrid"]}
    )
    mc = SimpleNamespace(
        model=str(model), model_weights="", revision=None, dtype="float32",
        quantization=quantization, hf_overrides={}, hf_config=hf, seed=0,
    )  # fmt: skip
    return SimpleNamespace(model_config=mc, load_config=SimpleNamespace(load_format=load_format))


def test_same_checkpoint_at_another_path_has_the_same_identity(tmp_path: Path) -> None:
    a = checkpoint(tmp_path / "mnt1" / "model")
    b = tmp_path / "elsewhere" / "copy"
    shutil.copytree(a, b)
    assert weights_identity(vllm_config(a)) == weights_identity(vllm_config(b))
    assert weights_identity(vllm_config(a)).startswith("TinyHybrid:")


@pytest.mark.parametrize("where", [0, 8191, 16383])  # start, middle, end of the tensor
def test_new_weights_at_the_same_path_change_the_identity(tmp_path: Path, where: int) -> None:
    root = checkpoint(tmp_path / "model")
    before = weights_identity(vllm_config(root))
    checkpoint(root, tweak=where)
    assert weights_identity(vllm_config(root)) != before


def test_quantization_dtype_and_explicit_id_change_the_identity(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "model")
    plain = weights_identity(vllm_config(root))
    assert weights_identity(vllm_config(root, quantization="fp8")) != plain
    assert weights_identity(vllm_config(root), weights_id="step-1000") != plain
    assert weights_identity(vllm_config(root), weights_id="step-1000") == weights_identity(
        vllm_config(tmp_path / "other"), weights_id="step-1000"
    )


def test_full_mode_sees_a_change_sampling_cannot(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "model")
    sampled, full = fingerprint_checkpoint(root), fingerprint_checkpoint(root, "full")
    checkpoint(root, tweak=4000)  # between the sampled points
    assert fingerprint_checkpoint(root) == sampled
    assert fingerprint_checkpoint(root, "full") != full


def test_a_folder_without_weights_is_an_error_not_a_shared_identity(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        fingerprint_checkpoint(tmp_path / "empty")


def test_a_checkpoint_inside_a_dot_cache_folder_is_still_read(tmp_path: Path) -> None:
    # Tool caches *inside* a checkpoint are skipped; a checkpoint that lives under ~/.cache is not.
    root = checkpoint(tmp_path / ".cache" / "models" / "m")
    assert fingerprint_checkpoint(root)
