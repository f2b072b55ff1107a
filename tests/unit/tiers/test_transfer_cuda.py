"""The GPU copy engine (``tiers.transfer_cuda``): exact bytes both ways through a pinned pool,
ordered against the compute stream on both sides, completion by events. Marked ``gpu``: they
are skipped where CUDA is absent (CI) and run by ``benchmarks/gpu_check.sh`` on a GPU machine.
"""

from __future__ import annotations

import time

import pytest
import torch

from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.transfer import LayerBlocks, plan_copies
from tests.harness.cuda_batch_op import batched_copy_op

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_BLOCKS = 64


def _engine(mode: str):  # noqa: ANN202 - imported lazily: the module needs CUDA
    """``staged``: scattered rows gathered on the device, one DMA range per slot; ``direct``:
    the plan's own pointer lists; both through vLLM's batched op, else the driver's batched
    copy through ctypes (a GPU machine without vLLM still checks them). ``torch``: slice
    copies, the fallback."""
    from himamba.tiers.transfer_cuda import CudaCopyEngine

    engine = CudaCopyEngine(batched=mode != "torch", staged=mode == "staged")
    engine.batched_calls = []  # type: ignore[attr-defined]
    if mode != "torch":
        op, _ = batched_copy_op()
        if op is None:
            pytest.skip("no batched copy op: neither vLLM nor libcuda's cuMemcpyBatchAsync")

        def counted(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor) -> None:
            engine.batched_calls.append(src.numel())
            op(src, dst, sizes)

        engine._op = counted
    return engine


MODES = ["staged", "direct", "torch"]


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


@pytest.mark.parametrize("mode", MODES)
def test_round_trip_through_the_pinned_pool_is_byte_exact(mode: str) -> None:
    layers, caches = _layers()
    pool = HostSlotPool([lb.block_bytes for lb in layers], 32, pin=True)
    before = {n: t.clone() for n, t in caches.items()}
    pages = caches["mamba"].as_strided((NUM_BLOCKS, 4096), (4096, 1))  # the padded pages
    pad_before = pages[:, 3000:].clone()
    src, slots, dst = [5, 6, 7, 8, 40, 2], [0, 1, 2, 3, 9, 31], [50, 51, 52, 53, 11, 60]
    engine = _engine(mode)
    store = engine.submit([plan_copies(layers, [src] * 3, pool, slots, True)])
    load = engine.submit([plan_copies(layers, [dst] * 3, pool, slots, False)])
    engine.wait([store, load])
    assert [r.ok for r in engine.collect([store, load])] == [True, True]
    for name, t in caches.items():
        dim = 1 if name == "split" else 0
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(t.select(dim, d), before[name].select(dim, s)), name
        for b in set(range(NUM_BLOCKS)) - set(dst):  # nothing written outside the targets
            assert torch.equal(t.select(dim, b), before[name].select(dim, b)), (name, b)
    assert torch.equal(pages[:, 3000:], pad_before)  # page padding past the state untouched
    # One driver call per plan: staged, one range per slot; direct, one per (block, segment).
    expect = {"staged": [6, 6], "direct": [24, 24], "torch": []}[mode]
    assert engine.batched_calls == expect
    engine.close()


def _sleep_seconds(cycles: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def _warm_up(engine: object, layers: list[LayerBlocks], pool: HostSlotPool, store: bool) -> None:
    """One job of the same kind, waited for. CUDA loads a kernel's module on its first use
    (lazy loading), and the load waits for the device: a first use inside a test would wait
    for the busy compute stream and hide the ordering the test checks."""
    job = engine.submit([plan_copies(layers, [[20]] * 3, pool, [5], store)])
    engine.wait([job])
    engine.collect([job])


@pytest.mark.parametrize("mode", MODES)
def test_a_store_reads_what_the_compute_stream_wrote_and_later_writes_wait_for_it(
    mode: str,
) -> None:
    layers, caches = _layers()
    pool = HostSlotPool([lb.block_bytes for lb in layers], 8, pin=True)
    dense = caches["dense"]
    engine = _engine(mode)
    _warm_up(engine, layers, pool, True)
    dense[3].fill_(0.0)  # and the fill kernel below
    slept = _sleep_seconds(200_000_000)
    torch.cuda._sleep(200_000_000)  # the compute stream is busy for a while ...
    dense[3].fill_(7.0)  # ... then writes the block the store reads
    t0 = time.perf_counter()
    job = engine.submit([plan_copies(layers, [[3]] * 3, pool, [0], True)])
    submit_s = time.perf_counter() - t0
    dense[3].fill_(-1.0)  # the next step rewrites the source: must run after the copy
    busy = not torch.cuda.current_stream().query()
    # The copy waits behind the busy compute stream (the message tells a sleep too short, a
    # submit that blocked, or a compute stream already drained apart).
    assert not engine.done(job), (mode, f"sleep {slept:.3f}s submit {submit_s:.4f}s busy {busy}")
    engine.wait([job])
    torch.cuda.synchronize()
    host = pool.rows[1][0].view(torch.float32)
    assert torch.all(host == 7.0)
    assert engine.collect([job])[0].ok
    engine.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_load_waits_for_the_zeroing_queued_before_it_and_completes_by_event(mode: str) -> None:
    layers, caches = _layers()
    pool = HostSlotPool([lb.block_bytes for lb in layers], 8, pin=True)
    pool.rows[1][2].view(torch.float32).fill_(5.0)
    dense = caches["dense"]
    engine = _engine(mode)
    _warm_up(engine, layers, pool, False)
    dense[9].zero_()  # and the zeroing kernel below
    torch.cuda._sleep(200_000_000)
    dense[9].zero_()  # vLLM zeroes a new block on the compute stream before the load
    job = engine.submit([plan_copies(layers, [[9]] * 3, pool, [2], False)])
    assert not engine.done(job) and engine.collect([job]) == []  # queued behind the zeroing
    engine.wait([job])
    assert engine.done(job) and engine.collect([job])[0].ok
    assert torch.all(dense[9] == 5.0)  # the load landed after the zeroing, not before
    engine.close()
