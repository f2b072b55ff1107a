"""Mamba1's prefill scan on vLLM's CPU platform, which ships without it.

vLLM's ``MambaMixer`` (Mamba1: Jamba, plain Mamba) prefills through
``selective_scan_fn``, whose op ``selective_scan_fwd`` exists only in the CUDA/ROCm/XPU builds:
on the CPU build every prefill of such a model dies with ``AttributeError: '_OpNamespace' '_C'
object has no attribute 'selective_scan_fwd'`` (decode has a CPU op, prefill has none). This
module supplies the op in torch, on CPU only, with the semantics the mixer relies on:

* varlen batches (``query_start_loc``), one state slot per sequence (``cache_indices``, the
  running Mamba block in ``align`` mode), sequences on the null block skipped;
* the initial state read from that slot when ``has_initial_state`` says so, else zeros;
* ``delta = softplus(delta + delta_bias)`` (threshold 20, as the kernel), the recurrence
  ``h = exp(delta * A) * h + delta * B * u`` and ``y = C . h + D * u`` in float32, the output
  written into ``delta`` and, gated by ``silu(z)``, into ``z``; the final state written back
  to the slot in the cache's dtype.

Decode has a CPU op, but it is Mamba2's: states ``(slots, heads, head_dim, dstate)`` and one
``A`` value per head. Given Mamba1's ``(slots, dim, dstate)`` state it fails (``IndexError:
Dimension out of range``), and reshaped as one head it runs but ignores Mamba1's per-channel,
per-state ``A`` (measured: wrong outputs and states). So the mixer's ``selective_state_update``
is wrapped: a 3-D (Mamba1) state goes to ``mamba1_decode_cpu``, the same recurrence as the
prefill scan for one token, in float32; anything else reaches vLLM's op untouched.

A third CPU gap on the same path: the mixer hands ``out_proj`` the scan output transposed (a
``(tokens, dim)`` view with a non-unit last stride), which CUDA GEMMs accept and the CPU build's
oneDNN GEMM refuses (``Expected a.stride(-1) == 1``). So, with the scan, CPU linear layers built
afterwards get such inputs as a contiguous copy (``contiguous_cpu_linear``); contiguous inputs,
every other layer's case, go through untouched.

It is a token-by-token recurrence, so a sequence computed in pieces (a prefix hit, chunked
prefill) threads the same float32 state through and matches one pass over it, the property the
connector's exact hits need. It is a Python loop over tokens: enough for the small models the
CPU build serves in tests and demos (0.13 s per Mamba1 layer for 1,000 tokens of the tiny
Jamba's 512 channels), slow for a production-size Jamba, which runs on GPUs with vLLM's
kernels. Mamba1's spec promises no prefill checkpoints, so the scheduler ends chunks on block
boundaries and the APC-mode arguments (per-block state indices) are never passed: they are
refused rather than ignored.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

OPS_MODULE = "vllm._custom_ops"
OP_NAME = "selective_scan_fwd"
UPDATE_NAME = "selective_state_update"
GEMM_MODULE = "vllm.model_executor.layers.utils"
GEMM_DISPATCH = "dispatch_cpu_unquantized_gemm"
_PATCH_FLAG = "_himamba_cpu_mamba1_scan"


def install(mixer_module: Any) -> bool:
    """Put the CPU scan in place of ``vllm._custom_ops.selective_scan_fwd`` when this build has
    no compiled op, with the Mamba1 decode step routed in ``mixer_module`` (vLLM's
    ``mamba_mixer``) and the GEMM guard; True when a working op is in place (vLLM's own or
    this one)."""
    import importlib

    ops = importlib.import_module(OPS_MODULE)
    current = getattr(ops, OP_NAME, None)
    if current is None:
        return False
    if getattr(current, _PATCH_FLAG, False) or _has_compiled_op():
        return True
    gemm = importlib.import_module(GEMM_MODULE)
    dispatch = getattr(gemm, GEMM_DISPATCH, None)
    update = getattr(mixer_module, UPDATE_NAME, None)
    if dispatch is None or update is None:
        return False
    if not getattr(update, _PATCH_FLAG, False):
        setattr(mixer_module, UPDATE_NAME, mamba1_state_update(update))
    if not getattr(dispatch, _PATCH_FLAG, False):
        setattr(gemm, GEMM_DISPATCH, contiguous_cpu_linear(dispatch))
    setattr(ops, OP_NAME, selective_scan_fwd_cpu)
    return True


def mamba1_state_update(update: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the mixer's decode op: a Mamba1 call (3-D state) goes to ``mamba1_decode_cpu``,
    anything else to vLLM's op as before."""

    @functools.wraps(update)
    def wrapped(state: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if state.dim() == 3:
            return mamba1_decode_cpu(state, *args, **kwargs)
        return update(state, *args, **kwargs)

    setattr(wrapped, _PATCH_FLAG, True)
    return wrapped


def mamba1_decode_cpu(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    z: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    dst_state_batch_indices: torch.Tensor | None = None,
    null_block_id: int = 0,
    out: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    **_: Any,
) -> None:
    """One decode token per row for Mamba1 (``state`` ``(slots, dim, dstate)``, ``x``/``dt``/``z``/
    ``out`` ``(rows, dim)``, ``B``/``C`` ``(rows, dstate)``): the scan's recurrence for one
    step, in float32, state read from ``state_batch_indices`` and written to
    ``dst_state_batch_indices``; rows on the null block are skipped."""
    if num_accepted_tokens is not None or cu_seqlens is not None:
        raise NotImplementedError("himamba CPU Mamba1 decode: no speculative decoding")
    if out is None or state_batch_indices is None:
        raise NotImplementedError("himamba CPU Mamba1 decode: indexed states and out only")
    src = state_batch_indices.tolist()
    dst = dst_state_batch_indices.tolist() if dst_state_batch_indices is not None else src
    a = A.float()
    d = D.float() if D is not None else None
    bias = dt_bias.float() if dt_bias is not None else None
    for i, slot in enumerate(src):
        if slot == null_block_id:
            continue
        h, y = _token_step(state[slot].float(), x[i], dt[i], a, B[i], C[i], d, bias, dt_softplus)
        if z is not None:
            y = y * torch.nn.functional.silu(z[i].float())
        out[i] = y.to(out.dtype)
        state[dst[i]] = h.to(state.dtype)


def _token_step(
    h: torch.Tensor,
    u: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor | None,
    bias: torch.Tensor | None,
    softplus: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the selective-scan recurrence in float32: the state after it and the
    ungated output. ``h`` ``(dim, dstate)``; ``u``, ``dt`` ``(dim,)``; ``b``, ``c`` ``(dstate,)``.
    Every op works on one token's column, so a token's bytes do not depend on how many tokens
    share a call (vectorised exp/softplus round a long tensor's tail elements differently):
    a sequence computed in pieces matches one pass bit for bit."""
    u = u.float()
    step = dt.float()
    if bias is not None:
        step = step + bias
    if softplus:
        step = torch.nn.functional.softplus(step)  # threshold 20, as the kernel
    h = torch.exp(step[:, None] * a) * h + (step * u)[:, None] * b.float()
    y = h @ c.float()
    if d is not None:
        y = y + d * u
    return h, y


def contiguous_cpu_linear(dispatch: Callable[..., None]) -> Callable[..., None]:
    """Wrap vLLM's CPU GEMM dispatch so the ``cpu_linear`` it gives a layer takes an input
    whose last stride is not 1 as a contiguous copy (the oneDNN and packed kernels read only
    that layout)."""

    @functools.wraps(dispatch)
    def wrapped(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        dispatch(layer, *args, **kwargs)
        inner = getattr(layer, "cpu_linear", None)
        if inner is None:
            return

        def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
            if x.dim() and x.stride(-1) != 1:
                x = x.contiguous()
            return inner(x, weight, bias)

        layer.cpu_linear = cpu_linear

    setattr(wrapped, _PATCH_FLAG, True)
    return wrapped


def is_installed(mixer_module: Any) -> bool:
    import importlib

    ops = importlib.import_module(OPS_MODULE)
    return all(
        getattr(getattr(m, name, None), _PATCH_FLAG, False)
        for m, name in ((ops, OP_NAME), (mixer_module, UPDATE_NAME))
    )


def _has_compiled_op() -> bool:
    try:
        return hasattr(torch.ops._C, OP_NAME)
    except (AttributeError, RuntimeError):
        return False


def selective_scan_fwd_cpu(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D_: torch.Tensor | None,
    z_: torch.Tensor | None,
    delta_bias_: torch.Tensor | None,
    delta_softplus: bool,
    query_start_loc: torch.Tensor | None,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    ssm_states: torch.Tensor,
    null_block_id: int,
    block_size: int = 1024,
    block_idx_first_scheduled_token: torch.Tensor | None = None,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    cu_chunk_seqlen: torch.Tensor | None = None,
    last_chunk_indices: torch.Tensor | None = None,
) -> None:
    """``vllm._custom_ops.selective_scan_fwd`` for varlen batches (the layout ``MambaMixer``
    passes: ``u``, ``delta``, ``z`` as ``(dim, tokens)``, ``B``/``C`` as ``(1, dstate, tokens)``,
    ``A`` as ``(dim, dstate)``). In place, like the compiled op."""
    if query_start_loc is None or cache_indices is None:
        raise NotImplementedError("himamba CPU selective_scan_fwd: varlen batches only")
    if cache_indices.dim() != 1 or block_idx_first_scheduled_token is not None:
        raise NotImplementedError(
            "himamba CPU selective_scan_fwd: one state slot per sequence only (Mamba1 prefix "
            "caching in 'all' mode is not supported on CPU)"
        )
    if B.dim() != 3 or B.size(0) != 1 or C.dim() != 3 or C.size(0) != 1:
        raise NotImplementedError("himamba CPU selective_scan_fwd: one B/C group only")
    starts = query_start_loc.tolist()
    slots = cache_indices.tolist()
    initial = has_initial_state.tolist() if has_initial_state is not None else None
    a = A.float()
    d = D_.float() if D_ is not None else None
    bias = delta_bias_.float() if delta_bias_ is not None else None
    for i, slot in enumerate(slots):
        start, end = starts[i], starts[i + 1]
        if slot == null_block_id or end <= start:
            continue
        h = (
            ssm_states[slot].float()
            if initial is not None and initial[i]
            else torch.zeros(a.shape, dtype=torch.float32)
        )
        for t in range(start, end):
            h, y = _token_step(
                h, u[:, t], delta[:, t], a, B[0, :, t], C[0, :, t], d, bias, delta_softplus
            )
            delta[:, t] = y.to(delta.dtype)
            if z_ is not None:
                z_[:, t] = (y * torch.nn.functional.silu(z_[:, t].float())).to(z_.dtype)
        ssm_states[slot] = h.to(ssm_states.dtype)


setattr(selective_scan_fwd_cpu, _PATCH_FLAG, True)
