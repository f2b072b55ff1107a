"""The native row copy (streaming stores) moves exactly the bytes the numpy path moves, refuses
rows outside their arrays, and steps aside when it cannot be built."""

from __future__ import annotations

import platform
import random
import shutil

import numpy as np
import pytest
import torch

from himamba.tiers import native_copy, transfer
from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.transfer import LayerBlocks, device_to_host, host_to_device

NUM_BLOCKS = 24
CAN_BUILD = platform.machine().lower() in ("x86_64", "amd64") and shutil.which("cc") is not None


@pytest.fixture
def fresh_helper(tmp_path, monkeypatch):
    """A helper built into an empty directory for this test (no cached library)."""
    monkeypatch.setenv(native_copy.ENV_DIR, str(tmp_path / "native"))
    monkeypatch.delenv(native_copy.ENV_SWITCH, raising=False)
    native_copy.native_row_copy.cache_clear()
    yield native_copy.native_row_copy
    native_copy.native_row_copy.cache_clear()


def _caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 127, (NUM_BLOCKS * 6144,), dtype=torch.int8, generator=g)
    return {
        # Rows of 32 KiB (streamed), a K/V split (two segments), and a Mamba page of 5,000
        # real bytes in a 6,144-byte page: an odd width, so rows start unaligned and end in a
        # partial line; the padding must stay untouched.
        "attn": torch.randn(NUM_BLOCKS, 2, 64, 64, generator=g),
        "split": torch.randn(2, NUM_BLOCKS, 16, 2, 64, generator=g),
        "mamba": torch.as_strided(raw, (NUM_BLOCKS, 1, 1, 5000), (6144, 5000, 5000, 1), 0),
        "small": torch.randn(NUM_BLOCKS, 100, generator=g),  # 400 B: memcpy inside the helper
    }


def _run(
    seed: int, native: bool, monkeypatch, isa: int = 0
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    helper = native_copy.native_row_copy() if native else None
    if helper is not None:
        helper.isa = isa
    monkeypatch.setattr(transfer, "native_row_copy", lambda: helper)
    monkeypatch.setattr(transfer, "stream_min_bytes", lambda: 0)  # these batches are small
    rng = random.Random(seed)
    caches = _caches(seed)
    raw = caches["mamba"].as_strided((NUM_BLOCKS * 6144,), (1,), 0)
    layers = [LayerBlocks.wrap(n, t, NUM_BLOCKS) for n, t in caches.items()]
    pool = HostSlotPool([layer.block_bytes for layer in layers], num_slots=16)
    for _ in range(6):
        n = rng.randint(1, 12)
        if rng.random() < 0.5:  # consecutive: runs of rows
            b0, s0 = rng.randint(1, NUM_BLOCKS - n), rng.randint(0, 16 - n)
            blocks, slots = list(range(b0, b0 + n)), list(range(s0, s0 + n))
        else:
            blocks, slots = rng.sample(range(1, NUM_BLOCKS), n), rng.sample(range(16), n)
        ids = [rng.sample(range(1, NUM_BLOCKS), n) if i == 3 else blocks for i in range(4)]
        if rng.random() < 0.5:
            device_to_host(layers, ids, pool, slots)
        else:
            host_to_device(layers, ids, pool, slots)
    return {k: v.clone() for k, v in caches.items()}, raw.clone()


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 and a C compiler (cc)")
def test_native_copies_equal_numpy_copies_on_random_plans(fresh_helper, monkeypatch):
    helper = fresh_helper()
    assert helper is not None and helper.path.exists()
    for seed in range(20):  # even seeds: the CPU's best (AVX2 here); odd: the SSE2 path
        native, native_raw = _run(seed, True, monkeypatch, isa=1 if seed % 2 else 0)
        ref, ref_raw = _run(seed, False, monkeypatch)
        for name in ref:
            assert torch.equal(native[name], ref[name]), (seed, name)
        # Page padding (bytes 5,000..6,143 of every page) included.
        assert torch.equal(native_raw, ref_raw), seed


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 and a C compiler (cc)")
def test_rows_outside_their_arrays_are_refused_before_any_copy(fresh_helper):
    helper = fresh_helper()
    src = np.arange(4 * 8192, dtype=np.int64).astype(np.uint8).reshape(4, 8192)
    dst = np.zeros((4, 8192), dtype=np.uint8)
    for bad_src, bad_dst in (([4], [0]), ([0], [4]), ([-1], [0]), ([0], [-1])):
        with pytest.raises(IndexError):
            helper.rows(src, dst, np.array(bad_src), np.array(bad_dst))
    with pytest.raises(ValueError, match="widths"):
        helper.rows(src, dst[:, :100], np.array([0]), np.array([0]))
    assert not dst.any()
    helper.rows(src, dst, np.array([3, 1]), np.array([0, 2]))
    assert np.array_equal(dst[[0, 2]], src[[3, 1]]) and not dst[[1, 3]].any()


def test_without_a_compiler_the_numpy_path_copies(fresh_helper, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert fresh_helper() is None
    native, native_raw = _run(3, True, monkeypatch)  # asks for the helper, gets numpy
    ref, ref_raw = _run(3, False, monkeypatch)
    assert all(torch.equal(native[k], ref[k]) for k in ref) and torch.equal(native_raw, ref_raw)


def test_switched_off_by_the_environment(fresh_helper, monkeypatch):
    monkeypatch.setenv(native_copy.ENV_SWITCH, "0")
    assert fresh_helper() is None


def test_small_batches_stay_on_numpy_and_the_threshold_reads_the_l3(tmp_path, monkeypatch):
    size = tmp_path / "size"
    size.write_text("32768K\n")
    assert native_copy._l3_bytes(str(size)) == 32 << 20
    size.write_text("garbage")
    assert native_copy._l3_bytes(str(size)) is None
    assert native_copy._l3_bytes(str(tmp_path / "missing")) is None
    calls = []  # the helper is never asked for a batch below the threshold
    monkeypatch.setattr(transfer, "native_row_copy", lambda: calls.append(1))
    monkeypatch.setattr(transfer, "stream_min_bytes", lambda: 1 << 40)
    layers = [LayerBlocks.wrap(n, t, NUM_BLOCKS) for n, t in _caches(0).items()]
    pool = HostSlotPool([layer.block_bytes for layer in layers], num_slots=16)
    device_to_host(layers, [[1, 2]] * 4, pool, [0, 1])
    assert calls == []
