"""The CPU Mamba2 prefill-checkpoint export against ground truth from vLLM's own CPU ops.

The scan's state at a checkpoint must be the state of a scan over the tokens before it, and
the conv window written at the checkpoint must be the conv state vLLM's CPU conv leaves after
those tokens: bit for bit, since a hit resumes from them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from himamba.connector.vllm_fixups.cpu_mamba2_checkpoints import (
    scan_with_chunk_states,
    store_prefill_checkpoint_cpu,
)

H, P, G, N = 4, 8, 1, 16  # heads, head dim, groups, state size


def _cpu_scan():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.mamba.ops.cpu import mamba_ssm

    return mamba_ssm._mamba_chunk_scan_combined_fwd_cpu


def _inputs(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(tokens, H, P, generator=g),
        "dt": torch.randn(tokens, H, generator=g),
        "A": -torch.rand(H, generator=g),
        "B": torch.randn(tokens, G, N, generator=g),
        "C": torch.randn(tokens, G, N, generator=g),
        "D": torch.randn(H, generator=g),
        "dt_bias": torch.randn(H, generator=g),
    }


def _reference(scan, t: dict[str, torch.Tensor], begin: int, end: int, init: torch.Tensor | None):
    """vLLM's CPU scan alone over tokens [begin, end) of one sequence: (out, final state)."""
    out = torch.empty(end - begin, H, P)
    state = scan(
        t["x"][begin:end].contiguous(), t["dt"][begin:end].contiguous(), t["A"],
        t["B"][begin:end].contiguous(), t["C"][begin:end].contiguous(), 64, out,
        D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True, initial_states=init,
        cu_seqlens=torch.tensor([0, end - begin], dtype=torch.int32), state_dtype=torch.float32,
    )  # fmt: skip
    return out, state


def test_chunk_states_match_separate_scans_bit_for_bit() -> None:
    """Three rows in one batch: row 0 checkpoints inside, row 1 does not, row 2 (with an
    initial state) checkpoints too. Every wanted chunk end holds the state of a scan over the
    tokens before it, and the outputs equal one plain scan's."""
    scan = _cpu_scan()
    lens = [300, 90, 200]
    cu = [0, 300, 390, 590]
    # chunks: row 0 [0,128) [128,256) [256,300); row 1 [300,390); row 2 [390,518) [518,590)
    cu_chunks = [0, 128, 256, 300, 390, 518, 590]
    last = [2, 3, 5]
    t = _inputs(sum(lens), seed=1)
    init = torch.zeros(3, H, P, N)
    init[2] = torch.randn(H, P, N, generator=torch.Generator().manual_seed(9))
    kw = dict(
        D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True, initial_states=init,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), state_dtype=torch.float32,
        cu_chunk_seqlens=torch.tensor(cu_chunks, dtype=torch.int32),
        last_chunk_indices=torch.tensor(last, dtype=torch.int32), seq_idx=None,
    )  # fmt: skip
    out_plain = torch.empty(sum(lens), H, P)
    finals = scan(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, out_plain, **kw)

    wrapped = scan_with_chunk_states(scan)
    out = torch.empty(sum(lens), H, P)
    # Outside a model forward no metadata names the checkpoints: every chunk end is wanted.
    states = wrapped(
        t["x"], t["dt"], t["A"], t["B"], t["C"], 64, out, return_intermediate_states=True, **kw
    )
    assert states.shape == (len(cu_chunks) - 1, H, P, N)
    assert torch.equal(out, out_plain)
    assert torch.equal(states[last], finals)
    for k, (row_start, end) in {0: (0, 128), 1: (0, 256), 4: (390, 518)}.items():
        row = 0 if k < 3 else 2
        _, want = _reference(scan, t, row_start, end, init[row : row + 1] if row else None)
        assert torch.equal(states[k], want[0]), k
    # Without the flag the wrapper is the plain scan.
    out_again = torch.empty(sum(lens), H, P)
    again = wrapped(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, out_again, **kw)
    assert torch.equal(again, finals) and torch.equal(out_again, out_plain)


def test_checkpoint_store_writes_the_conv_window_and_state_of_the_prefix() -> None:
    """The conv block gets what vLLM's CPU conv leaves after the tokens before the checkpoint;
    the SSM block gets the checkpoint chunk's state; a row with offset 0 writes nothing."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu

    dim, width, tokens = 24, 4, 300
    state_len = width - 1
    g = torch.Generator().manual_seed(3)
    x = torch.randn(dim, tokens, generator=g)  # pre-conv input, (dim, tokens)
    weight = torch.randn(dim, width, generator=g)
    blocks = 6
    conv_state = torch.full((blocks, dim, state_len), 7.0)
    ssm_state = torch.full((blocks, H, P, N), 7.0)
    chunk_states = torch.randn(5, H, P, N, generator=g)
    checkpoint = SimpleNamespace(
        offsets=[256, 0],
        checkpoint_offsets=torch.tensor([256, 0], dtype=torch.int32),
        state_indices=torch.tensor([4, 0], dtype=torch.int64),
    )
    store_prefill_checkpoint_cpu(
        checkpoint, torch.tensor([1, 0]), x, conv_state, chunk_states, ssm_state,
        torch.tensor([0, 280, 300], dtype=torch.int32), state_len=state_len,
    )  # fmt: skip

    ref_conv = torch.zeros(1, dim, state_len)
    causal_conv1d_fn_cpu(
        x[:, :256].contiguous(), weight, None, ref_conv,
        torch.tensor([0, 256], dtype=torch.int32), cache_indices=torch.tensor([0]),
        has_initial_state=torch.tensor([False]), activation="silu",
    )  # fmt: skip
    assert torch.equal(conv_state[4], ref_conv[0])
    assert torch.equal(ssm_state[4], chunk_states[1])
    untouched = [b for b in range(blocks) if b != 4]
    assert bool((conv_state[untouched] == 7.0).all()) and bool((ssm_state[untouched] == 7.0).all())


def test_checkpoint_inside_the_conv_window_is_refused() -> None:
    checkpoint = SimpleNamespace(offsets=[2], state_indices=torch.tensor([1]))
    with pytest.raises(ValueError, match="conv window"):
        store_prefill_checkpoint_cpu(
            checkpoint, torch.tensor([0]), torch.zeros(4, 10), torch.zeros(2, 4, 3),
            torch.zeros(1, H, P, N), torch.zeros(2, H, P, N), torch.tensor([0, 10]),
            state_len=3,
        )  # fmt: skip
