"""The staged whole-slot copy (``tiers.cuda_staging``), checked for layout on the CPU.

On a GPU the staging buffer is device memory and the ranges go to the driver's batched DMA;
here the buffer is host memory and each range is a ``memmove``, so the same plans exercise
every address the GPU path computes: each block lands in its slot's columns and back, other
layers' columns, other slots and slot headers stay untouched, chunks of a small buffer add up.
The GPU run of the same path is in ``test_transfer_cuda.py``.
"""

from __future__ import annotations

import ctypes

import torch

from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.cuda_staging import DeviceStaging, direct_ranges, worth_staging
from himamba.tiers.transfer import LayerBlocks, plan_copies

NUM_BLOCKS = 40
CPU = torch.device("cpu")


def _layers() -> list[LayerBlocks]:
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(-128, 127, (NUM_BLOCKS * 512,), dtype=torch.int8, generator=g)
    caches = [
        torch.randn(2, NUM_BLOCKS, 4, 8, generator=g),  # K/V split: two segments
        torch.randn(NUM_BLOCKS, 3, 16, generator=g),
        torch.as_strided(raw, (NUM_BLOCKS, 300), (512, 1)),  # a padded Mamba page view
    ]
    return [LayerBlocks.wrap(f"l{i}", t, NUM_BLOCKS) for i, t in enumerate(caches)]


def _memmove_dma(calls: list[int]):  # noqa: ANN202
    def dma(src: list[int], dst: list[int], sizes: list[int]) -> None:
        calls.append(len(src))
        for s, d, n in zip(src, dst, sizes, strict=True):
            ctypes.memmove(d, s, n)

    return dma


def _snapshot(layers: list[LayerBlocks]) -> list[torch.Tensor]:
    return [torch.cat([s.clone() for s in lb.segments], dim=1) for lb in layers]


def _assert_loaded(
    before: list[torch.Tensor], layers: list[LayerBlocks], blocks: list[int], targets: list[int]
) -> None:
    """Each target block now holds what ``blocks`` held in ``before``; no other block changed."""
    for snap, now in zip(before, _snapshot(layers), strict=True):
        for b, t in zip(blocks, targets, strict=True):
            assert torch.equal(now[t], snap[b])
        for other in set(range(NUM_BLOCKS)) - set(targets):
            assert torch.equal(now[other], snap[other])


def test_staged_round_trip_moves_exactly_the_planned_rows_in_chunks() -> None:
    layers = _layers()
    pool = HostSlotPool([lb.block_bytes for lb in layers], 16, head_bytes=64)
    pool._buffer.fill_(0xA5)
    blocks, slots = [7, 3, 30, 12, 5, 21, 9], [2, 11, 0, 5, 6, 15, 8]
    before = _snapshot(layers)
    # Room for two slots: the seven go in four chunks.
    staging, calls = DeviceStaging(CPU, capacity_bytes=2 * pool.stride + 10), []
    store = plan_copies(layers, [blocks] * 3, pool, slots, True)
    assert worth_staging(store) and direct_ranges(store) == 4 * 7
    assert staging.issue(store, _memmove_dma(calls))
    assert calls == [2, 2, 2, 1]  # one range per slot: the plan covers every column
    for lb, snap in zip(layers, before, strict=True):
        li = layers.index(lb)
        for b, s in zip(blocks, slots, strict=True):
            assert torch.equal(pool.rows[li][s], snap[b])
    untouched = [s for s in range(16) if s not in slots]
    grid = pool._buffer.view(-1, pool.stride)
    assert torch.all(grid[untouched] == 0xA5)
    assert torch.all(grid[:, :64] == 0xA5)  # slot headers never written

    targets = [33, 1, 18, 26, 38, 14, 4]
    assert staging.issue(plan_copies(layers, [targets] * 3, pool, slots, False), _memmove_dma([]))
    _assert_loaded(before, layers, blocks, targets)


def test_a_plan_over_some_layers_leaves_the_other_layers_columns_alone() -> None:
    layers = _layers()
    pool = HostSlotPool([lb.block_bytes for lb in layers], 8)
    pool._buffer.fill_(0x5A)
    before = _snapshot(layers)
    # Layers 0 and 2 only (say, one KV group's): layer 1's columns sit between them.
    plan = plan_copies(layers, [[4, 9, 2]] * 3, pool, [1, 6, 3], True)
    plan.segments = [g for i, g in enumerate(plan.segments) if i != 2]  # segment 2 = layer 1
    calls: list[int] = []
    assert DeviceStaging(CPU).issue(plan, _memmove_dma(calls))
    assert calls == [6]  # two column ranges per slot
    assert torch.all(pool.rows[1][[1, 6, 3]] == 0x5A)
    for b, s in zip([4, 9, 2], [1, 6, 3], strict=True):
        assert torch.equal(pool.rows[0][s], before[0][b])
        assert torch.equal(pool.rows[2][s], before[2][b])


def test_only_plans_of_many_small_ranges_are_staged() -> None:
    layers = _layers()
    pool = HostSlotPool([lb.block_bytes for lb in layers], 8)
    # Pool rows are strided (a slot holds every layer): one direct range per block and segment.
    plan = plan_copies(layers, [[1, 2, 3, 4]] * 3, pool, [0, 1, 2, 3], True)
    assert direct_ranges(plan) == 16 and worth_staging(plan)
    # One dense layer into a one-layer pool, consecutive ids: one range, nothing to gain.
    one = HostSlotPool([layers[1].block_bytes], 8)
    plan = plan_copies([layers[1]], [[1, 2, 3, 4]], one, [0, 1, 2, 3], True)
    assert direct_ranges(plan) == 1 and not worth_staging(plan)


def test_no_room_for_the_buffer_falls_back_to_the_direct_lists_for_good(monkeypatch) -> None:  # noqa: ANN001
    layers = _layers()
    pool = HostSlotPool([lb.block_bytes for lb in layers], 8)
    pool._buffer.fill_(0x11)
    staging = DeviceStaging(CPU)
    plan = plan_copies(layers, [[4, 9]] * 3, pool, [1, 6], True)

    def no_room(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", no_room)
        assert not staging.issue(plan, _memmove_dma([]))  # nothing queued: caller goes direct
    assert torch.all(pool._buffer == 0x11)
    assert not staging.issue(plan, _memmove_dma([]))  # and it does not retry every job


def _odd_layers() -> list[LayerBlocks]:
    """Rows whose widths and pool offsets allow 8-, 4-, 2- and 1-byte words."""
    g = torch.Generator().manual_seed(5)
    widths = [64, 36, 6, 7, 40]  # pool offsets 0, 64, 100, 106, 113: int64, int32, int16, bytes
    raw = [
        torch.randint(-128, 127, (NUM_BLOCKS * 128,), dtype=torch.int8, generator=g) for _ in widths
    ]
    return [
        LayerBlocks.wrap(f"w{w}", torch.as_strided(r, (NUM_BLOCKS, w), (128, 1)), NUM_BLOCKS)
        for w, r in zip(widths, raw, strict=True)
    ]


def test_rows_move_in_the_widest_word_their_alignment_allows_and_stay_exact() -> None:
    layers = _odd_layers()
    pool = HostSlotPool([lb.block_bytes for lb in layers], 12)
    pool._buffer.fill_(0x3C)
    staging = DeviceStaging(CPU, capacity_bytes=3 * pool.stride)
    blocks, slots = [11, 2, 37, 20, 5], [9, 0, 4, 7, 1]
    before = _snapshot(layers)
    store = plan_copies(layers, [blocks] * len(layers), pool, slots, True)
    assert staging.issue(store, _memmove_dma([]))
    (geo,) = staging._geometries.values()
    assert [s.dtype for s in geo.segs] == [
        torch.int64,
        torch.int32,
        torch.int16,
        torch.uint8,
        torch.uint8,
    ]
    for li, snap in enumerate(before):
        for b, s in zip(blocks, slots, strict=True):
            assert torch.equal(pool.rows[li][s], snap[b])
    grid = pool._buffer.view(-1, pool.stride)
    assert torch.all(grid[[s for s in range(12) if s not in slots]] == 0x3C)
    assert torch.all(grid[:, pool.slot_bytes :] == 0x3C)  # the slot's padding

    targets = [30, 8, 1, 16, 25]
    assert staging.issue(
        plan_copies(layers, [targets] * len(layers), pool, slots, False), _memmove_dma([])
    )
    _assert_loaded(before, layers, blocks, targets)


def test_a_layout_is_worked_out_once_and_a_new_buffer_is_never_written_through_old_views() -> None:
    layers = _layers()
    small = HostSlotPool([lb.block_bytes for lb in layers], 8)
    # A pool with a wider slot (header room) makes the buffer grow between two jobs of `small`.
    wide = HostSlotPool([lb.block_bytes for lb in layers], 8, head_bytes=1024)
    staging = DeviceStaging(CPU, capacity_bytes=2 * small.stride + 10)
    before = _snapshot(layers)
    for pool, blocks, slots in [
        (small, [3, 17], [5, 2]),
        (small, [9, 1], [0, 7]),  # same layout: no new geometry
        (wide, [30, 6], [1, 4]),  # grows the buffer
        (small, [22, 14], [6, 3]),  # back to the first layout, on the new buffer
    ]:
        assert staging.issue(plan_copies(layers, [blocks] * 3, pool, slots, True), _memmove_dma([]))
        for li, snap in enumerate(before):
            for b, s in zip(blocks, slots, strict=True):
                assert torch.equal(pool.rows[li][s], snap[b])
    assert len(staging._geometries) == 2
