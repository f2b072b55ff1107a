"""cpu_compat's Mamba1 ops for vLLM's CPU build (``vllm_fixups.cpu_mamba1_scan``), on plain
tensors: the varlen prefill scan, the decode step, and the GEMM input guard.

The reference is the textbook selective-scan recurrence written out per token; the e2e test
(``tests/e2e/test_cpu_mamba1.py``) checks the ops inside a real engine against transformers'
own Jamba."""

from __future__ import annotations

import torch

from himamba.connector.vllm_fixups.cpu_mamba1_scan import (
    contiguous_cpu_linear,
    mamba1_decode_cpu,
    mamba1_state_update,
    selective_scan_fwd_cpu,
)

DIM, N, SLOTS = 6, 4, 5
NULL = 0


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "A": -torch.rand(DIM, N, generator=g),
        "D": torch.randn(DIM, generator=g),
        "bias": torch.randn(DIM, generator=g),
    }


def _tokens(t: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "u": torch.randn(DIM, t, generator=g),
        "dt": torch.randn(DIM, t, generator=g),
        "B": torch.randn(1, N, t, generator=g),
        "C": torch.randn(1, N, t, generator=g),
        "z": torch.randn(DIM, t, generator=g),
    }


def _reference(p, x, h0):
    """Per-token recurrence of one sequence: (gated outputs (DIM, T), final state)."""
    h = h0.clone()
    out = torch.empty_like(x["u"])
    for t in range(x["u"].shape[1]):
        d = torch.nn.functional.softplus(x["dt"][:, t] + p["bias"])
        h = torch.exp(d[:, None] * p["A"]) * h + (d * x["u"][:, t])[:, None] * x["B"][0, :, t]
        y = h @ x["C"][0, :, t] + p["D"] * x["u"][:, t]
        out[:, t] = y * torch.nn.functional.silu(x["z"][:, t])
    return out, h


def _scan(p, x, starts, slots, initial, states):
    z = x["z"].clone()
    selective_scan_fwd_cpu(
        x["u"], x["dt"].clone(), p["A"], x["B"], x["C"], p["D"], z, p["bias"], True,
        torch.tensor(starts, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32),
        torch.tensor(initial), states, NULL,
    )  # fmt: skip
    return z


def test_varlen_scan_matches_the_recurrence_per_sequence_and_skips_the_null_block():
    p = _params(0)
    x = _tokens(12, 1)
    states = torch.randn(SLOTS, DIM, N)
    before = states.clone()
    # three sequences: 5 tokens from a stored state (slot 2), 4 from zeros (slot 3), 3 padding
    z = _scan(p, x, [0, 5, 9, 12], [2, 3, NULL], [True, False, False], states)
    for (s, e), slot, h0 in (((0, 5), 2, before[2]), ((5, 9), 3, torch.zeros(DIM, N))):
        part = {k: v[..., s:e] for k, v in x.items()}
        want, h = _reference(p, part, h0)
        torch.testing.assert_close(z[:, s:e], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[slot], h, rtol=1e-5, atol=1e-5)
    assert torch.equal(z[:, 9:], x["z"][:, 9:]), "a padding row was computed"
    for slot in (0, 1, 4):
        assert torch.equal(states[slot], before[slot]), f"slot {slot} written"


def test_a_sequence_scanned_in_two_pieces_gives_the_bytes_of_one_pass():
    """What exact prefix hits rest on: the state after the first piece, stored and read back
    as the second piece's initial state, continues the recurrence bit for bit."""
    p = _params(2)
    x = _tokens(9, 3)
    whole = torch.zeros(SLOTS, DIM, N)
    z_whole = _scan(p, x, [0, 9], [1], [False], whole)
    pieces = torch.zeros(SLOTS, DIM, N)
    head = {k: v[..., :5].contiguous() for k, v in x.items()}
    tail = {k: v[..., 5:].contiguous() for k, v in x.items()}
    z_head = _scan(p, head, [0, 5], [1], [False], pieces)
    pieces[3] = pieces[1]  # vLLM's pre-copy moves the state into the next running block
    z_tail = _scan(p, tail, [0, 4], [3], [True], pieces)
    assert torch.equal(torch.cat([z_head, z_tail], dim=1), z_whole)
    assert torch.equal(pieces[3], whole[1])


def test_bf16_activations_keep_a_float32_state():
    p = _params(4)
    x = {k: v.to(torch.bfloat16) for k, v in _tokens(6, 5).items()}
    states = torch.zeros(SLOTS, DIM, N, dtype=torch.float32)
    z = _scan(p, x, [0, 6], [1], [False], states)
    assert z.dtype == torch.bfloat16
    want, h = _reference(p, {k: v.float() for k, v in x.items()}, torch.zeros(DIM, N))
    torch.testing.assert_close(states[1], h, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(z.float(), want, rtol=2e-2, atol=2e-2)


def test_decode_step_matches_the_recurrence_and_writes_the_destination_slot():
    p = _params(6)
    g = torch.Generator().manual_seed(7)
    rows = 3
    x, dt, z = (torch.randn(rows, DIM, generator=g) for _ in range(3))
    B, C = (torch.randn(rows, N, generator=g) for _ in range(2))
    states = torch.randn(SLOTS, DIM, N, generator=g)
    before = states.clone()
    out = torch.full((rows, DIM), 7.0)
    mamba1_decode_cpu(
        states, x, dt, p["A"], B, C, p["D"], p["bias"], z=z, dt_softplus=True,
        state_batch_indices=torch.tensor([1, NULL, 2], dtype=torch.int32),
        dst_state_batch_indices=torch.tensor([4, NULL, 2], dtype=torch.int32),
        null_block_id=NULL, out=out,
    )  # fmt: skip
    for row, src, dst in ((0, 1, 4), (2, 2, 2)):
        one = {"u": x[row, :, None], "dt": dt[row, :, None], "z": z[row, :, None]}
        one |= {"B": B[row][None, :, None], "C": C[row][None, :, None]}
        want, h = _reference(p, one, before[src])
        torch.testing.assert_close(out[row], want[:, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[dst], h, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], torch.full((DIM,), 7.0)), "the null row was computed"
    assert torch.equal(states[1], before[1]) and torch.equal(states[3], before[3])


def test_the_decode_wrapper_sends_only_mamba1_states_to_the_torch_step():
    seen = []
    wrapped = mamba1_state_update(lambda state, *a, **k: seen.append(state.dim()))
    wrapped(torch.zeros(2, 3, 4, 5), None, None)  # Mamba2: (slots, heads, head_dim, dstate)
    assert seen == [4]
    states = torch.zeros(SLOTS, DIM, N)
    out = torch.zeros(1, DIM)
    p = _params(8)
    wrapped(
        states, torch.ones(1, DIM), torch.ones(1, DIM), p["A"], torch.ones(1, N),
        torch.ones(1, N), p["D"], p["bias"], None, True, torch.tensor([1]), torch.tensor([1]),
        NULL, out=out,
    )  # fmt: skip
    assert seen == [4] and out.abs().sum() > 0 and states[1].abs().sum() > 0


def test_gemm_guard_copies_only_inputs_with_a_strided_last_dimension():
    got = []

    class Layer(torch.nn.Module):
        pass

    def dispatch(layer, remove_weight=False):
        layer.cpu_linear = lambda x, w, b: got.append(x) or x

    layer = Layer()
    contiguous_cpu_linear(dispatch)(layer, remove_weight=True)
    plain = torch.randn(4, 6)
    strided = torch.randn(6, 4).t()
    layer.cpu_linear(plain, None, None)
    layer.cpu_linear(strided, None, None)
    assert got[0] is plain
    assert got[1].stride(-1) == 1 and torch.equal(got[1], strided)
