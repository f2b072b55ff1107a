"""The GPU copy engine (``tiers.transfer_cuda``): exact bytes both ways through a pinned pool,
ordered against the compute stream on both sides, completion by events. Marked ``gpu``: they
are skipped where CUDA is absent (CI) and run by ``benchmarks/gpu_check.sh`` on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.transfer import LayerBlocks, plan_copies

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_BLOCKS = 64


def _engine(batched: bool):  # noqa: ANN202 - imported lazily: the module needs CUDA
    from himamba.tiers.transfer_cuda import CudaCopyEngine

    return CudaCopyEngine(batched=batched)


def _layers() -> tuple[list[LayerBlocks], dict[str, torch.Tensor]]:
    dev = torch.device("cuda")
    raw = torch.randint(-128, 127, (NUM_BLOCKS * 4096,), dtype=torch.int8, device=dev)
    caches = {
        # GPU flash layout: [2, num_blocks, block_size, kv_heads, head_size]
        "split": torch.randn(2, NUM_BLOCKS, 16, 4, 64, device=dev, dtype=torch.bfloat16),
        "dense": torch.randn(NUM_BLOCKS, 16, 256, device=dev),
        # a Mamba page view: 3000 real bytes in 4096-byte pages
        "mamba": torch.as_strided(raw, (NUM_BLOCKS, 3000), (4096, 1)),
    }
    return [LayerBlocks.wrap(n, t, NUM_BLOCKS) for n, t in caches.items()], caches


@pytest.mark.parametrize("batched", [True, False])
def test_round_trip_through_the_pinned_pool_is_byte_exact(batched: bool) -> None:
    layers, caches = _layers()
    pool = HostSlotPool([lb.block_bytes for lb in layers], 32, pin=True)
    before = {n: t.clone() for n, t in caches.items()}
    src, slots, dst = [5, 6, 7, 8, 40, 2], [0, 1, 2, 3, 9, 31], [50, 51, 52, 53, 11, 60]
    engine = _engine(batched)
    store = engine.submit([plan_copies(layers, [src] * 3, pool, slots, True)])
    load = engine.submit([plan_copies(layers, [dst] * 3, pool, slots, False)])
    engine.wait([store, load])
    assert [r.ok for r in engine.collect([store, load])] == [True, True]
    for name, t in caches.items():
        dim = 1 if name == "split" else 0
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(t.select(dim, d), before[name].select(dim, s)), name
    engine.close()


def test_a_store_reads_what_the_compute_stream_wrote_and_later_writes_wait_for_it() -> None:
    layers, caches = _layers()
    pool = HostSlotPool([lb.block_bytes for lb in layers], 8, pin=True)
    dense = caches["dense"]
    engine = _engine(True)
    torch.cuda._sleep(200_000_000)  # the compute stream is busy for a while ...
    dense[3].fill_(7.0)  # ... then writes the block the store reads
    job = engine.submit([plan_copies(layers, [[3]] * 3, pool, [0], True)])
    dense[3].fill_(-1.0)  # the next step rewrites the source: must run after the copy
    assert not engine.done(job)  # the copy waits behind the busy compute stream
    engine.wait([job])
    torch.cuda.synchronize()
    host = pool.rows[1][0].view(torch.float32)
    assert torch.all(host == 7.0)
    assert engine.collect([job])[0].ok
    engine.close()


def test_a_load_waits_for_the_zeroing_queued_before_it_and_completes_by_event() -> None:
    layers, caches = _layers()
    pool = HostSlotPool([lb.block_bytes for lb in layers], 8, pin=True)
    pool.rows[1][2].view(torch.float32).fill_(5.0)
    dense = caches["dense"]
    engine = _engine(True)
    torch.cuda._sleep(200_000_000)
    dense[9].zero_()  # vLLM zeroes a new block on the compute stream before the load
    job = engine.submit([plan_copies(layers, [[9]] * 3, pool, [2], False)])
    assert engine.collect([job]) == [] or not engine.done(job)
    engine.wait([job])
    assert engine.done(job) and engine.collect([job])[0].ok
    assert torch.all(dense[9] == 5.0)  # the load landed after the zeroing, not before
    engine.close()
