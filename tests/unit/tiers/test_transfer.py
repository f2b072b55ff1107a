"""Block copies between vLLM-shaped caches and host slots keep every byte, in any layout."""

from __future__ import annotations

import torch

from himamba.mamba_state.snapshot import MambaSnapshotter
from himamba.mamba_state.state_layout import MambaStateLayout
from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.transfer import LayerBlocks, device_to_host, host_to_device
from tests.unit.tiers.pool_helpers import read_slot, write_slot

NUM_BLOCKS = 16


def _attention_block_first() -> torch.Tensor:
    # CPU layout: [num_blocks, kv_heads, block_size, 2 * head_size], bf16.
    return torch.randn(NUM_BLOCKS, 2, 8, 16).to(torch.bfloat16)


def _attention_kv_split() -> torch.Tensor:
    # GPU flash layout: [2, num_blocks, block_size, kv_heads, head_size].
    return torch.randn(2, NUM_BLOCKS, 8, 2, 8)


def _mamba_page_view(raw: torch.Tensor, offset: int, real: int, page: int) -> torch.Tensor:
    # vLLM's Mamba view: int8 [num_blocks, 1, 1, real] with a padded page stride.
    return torch.as_strided(raw, (NUM_BLOCKS, 1, 1, real), (page, real, real, 1), offset)


def test_round_trip_restores_exact_bytes_for_every_layout():
    raw = torch.randint(-128, 127, (NUM_BLOCKS * 256 * 2,), dtype=torch.int8)
    caches = {
        "attn": _attention_block_first(),
        "split": _attention_kv_split(),
        "mamba": _mamba_page_view(raw, 0, 200, 256),
        "mamba2": _mamba_page_view(raw, NUM_BLOCKS * 256, 200, 256),
    }
    layers = [LayerBlocks.wrap(n, t, NUM_BLOCKS) for n, t in caches.items()]
    assert [layer.block_dim for layer in layers] == [0, 1, 0, 0]
    assert layers[2].block_bytes == 200
    pool = HostSlotPool([layer.block_bytes for layer in layers], num_slots=4)
    src_blocks = [3, 7, 11]
    slots = [2, 0, 3]
    before = {n: t.clone() for n, t in caches.items()}
    device_to_host(layers, [src_blocks] * 4, pool, slots)
    # Restore into other blocks and compare block by block.
    dst_blocks = [1, 5, 9]
    host_to_device(layers, [dst_blocks] * 4, pool, slots)
    for name, tensor in caches.items():
        dim = 1 if name == "split" else 0
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            assert torch.equal(tensor.select(dim, d), before[name].select(dim, s)), name


def test_mamba_restore_leaves_page_padding_and_neighbours_untouched():
    raw = torch.zeros(NUM_BLOCKS * 64, dtype=torch.int8)
    view = _mamba_page_view(raw, 0, 40, 64)
    view[4].fill_(7)
    layer = LayerBlocks.wrap("m", view, NUM_BLOCKS)
    pool = HostSlotPool([layer.block_bytes], num_slots=2)
    snap = MambaSnapshotter([layer], [1], pool)
    snap.plan_snapshot([[4]], [1]).run_host()
    snap.plan_restore([[6]], [1]).run_host()
    page6 = raw[6 * 64 : 7 * 64]
    assert torch.all(page6[:40] == 7) and torch.all(page6[40:] == 0)
    assert torch.all(raw[5 * 64 : 6 * 64] == 0) and torch.all(raw[7 * 64 : 8 * 64] == 0)


def test_slot_read_write_round_trip_concatenates_layers():
    pool = HostSlotPool([3, 5], num_slots=2)
    pool.rows[0][1] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    pool.rows[1][1] = torch.tensor([4, 5, 6, 7, 8], dtype=torch.uint8)
    data = read_slot(pool, 1)
    assert data.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    write_slot(pool, 0, data)
    assert read_slot(pool, 0).tolist() == data.tolist()


def test_state_layout_unpacks_conv_then_ssm_views():
    layout = MambaStateLayout.from_spec([(3, 4), (2, 2)], [torch.bfloat16, torch.float32])
    assert layout.nbytes == 3 * 4 * 2 + 4 * 4
    page = torch.zeros(64, dtype=torch.int8)
    conv, ssm = layout.unpack(page)
    ssm.fill_(1.5)
    conv.fill_(2.0)
    again_conv, again_ssm = layout.unpack(page)
    assert torch.all(again_ssm == 1.5) and torch.all(again_conv == 2.0)
