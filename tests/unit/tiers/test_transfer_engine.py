"""The copy engine's contract on CPU: jobs run off the caller's thread, in submission order,
exactly; a failed copy fails its job only; consecutive ids move as one copy per run; the worker
fences stores before anything can rewrite their source blocks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from himamba.tiers.cpu_pool import HostSlotPool
from himamba.tiers.transfer import CopyPlan, LayerBlocks, _runs, plan_copies
from himamba.tiers.transfer_engine import HostCopyEngine

NUM_BLOCKS = 32


def _setup(num_slots: int = 16) -> tuple[list[LayerBlocks], HostSlotPool, dict[str, torch.Tensor]]:
    caches = {
        "attn": torch.randn(NUM_BLOCKS, 2, 8, 16),  # block-first CPU layout
        "split": torch.randn(2, NUM_BLOCKS, 8, 2, 8),  # K/V split: two segments per block
    }
    layers = [LayerBlocks.wrap(n, t, NUM_BLOCKS) for n, t in caches.items()]
    return layers, HostSlotPool([lb.block_bytes for lb in layers], num_slots), caches


class _Gate(CopyPlan):
    """A plan that holds the copy thread until released: the only way to observe a job that
    has been submitted but has not run yet."""

    def __init__(self) -> None:
        super().__init__(True, [], 0)
        self.release = threading.Event()
        self.ran = threading.Event()

    def run_host(self) -> None:
        self.release.wait(10)
        self.ran.set()


class _Broken(CopyPlan):
    def __init__(self) -> None:
        super().__init__(True, [], 0)

    def run_host(self) -> None:
        raise OSError("injected copy fault")


def test_consecutive_blocks_and_slots_move_as_one_copy_per_segment() -> None:
    assert _runs([5, 6, 7, 9, 10], [0, 1, 2, 3, 4]) == [(5, 0, 3), (9, 3, 2)]
    assert _runs([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]
    layers, pool, _ = _setup()
    plan = plan_copies(layers, [list(range(4, 12))] * 2, pool, list(range(8)), to_host=True)
    assert len(plan.copies) == 3  # attn: one segment; split: K and V
    assert plan.nbytes == 8 * pool.slot_bytes
    with pytest.raises(ValueError, match="blocks for"):
        plan_copies(layers, [[1, 2]] * 2, pool, [0], to_host=True)


@pytest.mark.parametrize("consecutive", [True, False])
def test_jobs_run_off_the_callers_thread_in_order_and_exactly(consecutive: bool) -> None:
    layers, pool, caches = _setup()
    before = {n: t.clone() for n, t in caches.items()}
    src = list(range(4, 12)) if consecutive else [9, 4, 17, 3, 30, 12, 5, 21]
    slots = list(range(8)) if consecutive else [7, 0, 3, 5, 1, 6, 2, 4]
    dst = list(range(20, 28)) if consecutive else [25, 1, 13, 28, 2, 19, 31, 11]
    engine = HostCopyEngine()
    try:
        gate = _Gate()
        first = engine.submit([gate])
        store = engine.submit([plan_copies(layers, [src] * 2, pool, slots, True)])
        load = engine.submit([plan_copies(layers, [dst] * 2, pool, slots, False)])
        assert first < store < load
        # Nothing ran yet: the caller was never blocked, and order is kept behind the gate.
        assert not engine.done(store) and engine.pending() == 3
        assert np.all(pool.np_rows[0] == 0)
        gate.release.set()
        engine.wait([load])
        assert engine.done(store)  # FIFO: the store ran before the load that reads its slots
        results = engine.collect([first, store, load])
        assert [r.ok for r in results] == [True, True, True]
        assert engine.collect([store]) == []  # collected once
        for name, t in caches.items():
            dim = 1 if name == "split" else 0
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(t.select(dim, d), before[name].select(dim, s)), name
    finally:
        engine.close()


def test_a_failed_copy_fails_its_job_and_the_engine_goes_on() -> None:
    layers, pool, caches = _setup()
    engine = HostCopyEngine()
    try:
        bad = engine.submit([_Broken()])
        good = engine.submit([plan_copies(layers, [[3]] * 2, pool, [1], True)])
        engine.wait()
        results = {r.job_id: r for r in engine.collect([bad, good])}
        assert not results[bad].ok and "injected copy fault" in results[bad].error
        assert results[good].ok
        assert torch.equal(pool.rows[0][1], layers[0].read_blocks([3])[0])
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([])


def test_close_finishes_what_was_submitted() -> None:
    engine = HostCopyEngine()
    gate = _Gate()
    engine.submit([gate])
    threading.Timer(0.05, gate.release.set).start()
    t0 = time.monotonic()
    engine.close()
    assert gate.ran.is_set() and time.monotonic() - t0 >= 0.04
