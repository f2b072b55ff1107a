"""Mamba2 prefill checkpoints on vLLM's CPU platform: the two pieces vLLM only has for GPUs.

vLLM's ``MambaMixer2`` promises one *prefill checkpoint block*: when a prompt's last chunk
starts on a hash-block boundary and runs past the prompt's last such boundary, the model
saves the state *at* that boundary from inside the chunk, and the scheduler does not stop the
chunk there. That takes two things the CPU build lacks:

* the chunk scan must return a state per logical chunk (``return_intermediate_states``); the
  CPU op returns one final state per sequence;
* ``store_prefill_checkpoint`` (a Triton kernel) copies the checkpoint chunk's SSM state and
  the conv window (the ``state_len`` pre-conv inputs before the boundary) into the
  checkpoint's paged block.

This module supplies both, on CPU only. The CPU scan op is a token-by-token recurrence, so
running it over a sequence in pieces, the running float32 state threaded through, gives the
same bytes as one call (``tests/unit/connector/test_cpu_mamba2_checkpoints.py`` checks it). Only the chunk ends the mixer
reads are materialised (each row's last chunk and its checkpoint chunk, found in the step's
attention metadata), so a step with a checkpoint costs one extra op call per checkpointing
row, not one per 256-token chunk. With both in place ``cpu_compat`` leaves vLLM's promise
alone: CPU engines take the scheduler path GPU engines take (one prefill step fewer for every
long prompt, and the tests exercise the checkpoint blocks production runs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SSD_MODULE = "vllm.model_executor.layers.mamba.ops.ssd_combined"
SCAN_NAME = "_mamba_chunk_scan_combined_fwd"
STORE_NAME = "store_prefill_checkpoint"
_PATCH_FLAG = "_himamba_cpu_checkpoints"


def install(mixer2_module: Any) -> bool:
    """Give ``mamba_mixer2`` (the imported module) a CPU checkpoint export; True when both the
    scan and the store are in place (already or now)."""
    import importlib

    ssd = importlib.import_module(SSD_MODULE)
    scan = getattr(ssd, SCAN_NAME, None)
    store = getattr(mixer2_module, STORE_NAME, None)
    if scan is None or store is None:
        return False
    if not getattr(scan, _PATCH_FLAG, False):
        setattr(ssd, SCAN_NAME, scan_with_chunk_states(scan))
    if not getattr(store, _PATCH_FLAG, False):
        setattr(mixer2_module, STORE_NAME, store_prefill_checkpoint_cpu)
    return True


def is_installed(mixer2_module: Any) -> bool:
    import importlib

    ssd = importlib.import_module(SSD_MODULE)
    return bool(
        getattr(getattr(ssd, SCAN_NAME, None), _PATCH_FLAG, False)
        and getattr(getattr(mixer2_module, STORE_NAME, None), _PATCH_FLAG, False)
    )


def scan_with_chunk_states(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap the CPU chunk scan so ``return_intermediate_states=True`` returns one state per
    logical chunk (rows the mixer never reads stay zero); other calls go through unchanged."""

    def scan(x, dt, A, B, C, chunk_size, out, **kw):  # noqa: ANN001, ANN202, N803 (vLLM's names)
        cu_chunks = kw.get("cu_chunk_seqlens")
        if not kw.get("return_intermediate_states") or cu_chunks is None:
            return original(x, dt, A, B, C, chunk_size, out, **kw)
        import torch

        bounds = cu_chunks.tolist()
        rows = kw["cu_seqlens"].tolist()
        last = kw["last_chunk_indices"].tolist()
        wanted = set(last) | _checkpoint_chunks(cu_chunks, len(bounds) - 1)
        initial = kw.get("initial_states")
        state_dtype = kw.get("state_dtype") or x.dtype
        states = torch.zeros((len(bounds) - 1, *_state_shape(x, B)), dtype=state_dtype)
        piece = dict(kw, return_intermediate_states=False, cu_chunk_seqlens=None)
        piece.update(last_chunk_indices=None, seq_idx=None, state_dtype=torch.float32)
        # dt once for the whole batch, as one call would: torch's vectorised softplus rounds
        # a token's dt by its place in the tensor, so a slice would not give the same bits.
        dt = _prepared_dt(dt, kw)
        piece.update(dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")))

        def run(begin: int, end: int, init: torch.Tensor | None, cu: list[int]) -> torch.Tensor:
            """One op call over tokens [begin, end); float32 states back, one per sequence."""
            return original(
                x[begin:end], dt[begin:end], A, B[begin:end], C[begin:end], chunk_size,
                out[begin:end],
                **dict(
                    piece,
                    z=None if kw.get("z") is None else kw["z"][begin:end],
                    initial_states=init,
                    cu_seqlens=torch.tensor([c - begin for c in cu], dtype=torch.int32),
                ),
            )  # fmt: skip

        first, r = 0, 0  # row r's first chunk, the row
        while r < len(last):
            # Rows that want no state before their last chunk run together in one call.
            s, f = r, first
            while s < len(last) and not _interior(wanted, f, last[s]):
                f, s = last[s] + 1, s + 1
            if s > r:
                final = run(
                    rows[r], rows[s], None if initial is None else initial[r:s], rows[r : s + 1]
                )
                for i in range(r, s):
                    states[last[i]] = final[i - r]
                first, r = f, s
                continue
            # Row r wants a state inside: run it piece by piece, the float32 state threaded.
            running = None if initial is None else initial[r : r + 1]
            begin = rows[r]
            for k in range(first, last[r] + 1):
                if k not in wanted:
                    continue
                if bounds[k + 1] > begin:
                    running = run(begin, bounds[k + 1], running, [begin, bounds[k + 1]])
                    begin = bounds[k + 1]
                if running is not None:
                    states[k] = running[0]
            first, r = last[r] + 1, r + 1
        return states

    setattr(scan, _PATCH_FLAG, True)
    scan.__wrapped__ = original  # type: ignore[attr-defined]
    return scan


def _prepared_dt(dt: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor:
    """``dt`` as the CPU scan prepares it (float32, plus bias, softplus, clamp)."""
    import torch

    dt_f = dt.float()
    if kw.get("dt_bias") is not None:
        dt_f = dt_f + kw["dt_bias"].float().unsqueeze(0)
    if kw.get("dt_softplus"):
        dt_f = torch.nn.functional.softplus(dt_f)
    low, high = kw.get("dt_limit", (0.0, float("inf")))
    if low > 0.0 or high < float("inf"):
        dt_f = dt_f.clamp(min=low, max=high)
    return dt_f.contiguous()


def _interior(wanted: set[int], first: int, last: int) -> bool:
    """True when a row (chunks ``first..last``) needs a state before its last chunk."""
    return any(k in wanted for k in range(first, last))


def _state_shape(x: torch.Tensor, B: torch.Tensor) -> tuple[int, int, int]:  # noqa: N803
    """``(nheads, headdim, dstate)`` of the scan's states."""
    return x.shape[1], x.shape[2], B.shape[2]


def _checkpoint_chunks(cu_chunks: torch.Tensor, num_chunks: int) -> set[int]:
    """The chunk indices that end on a prefill checkpoint this step.

    They live in the step's Mamba2 attention metadata, found by the identity of its
    ``cu_chunk_seqlen_p`` (the tensor this scan was given). Not found (another caller, a
    vLLM whose metadata moved): every chunk, which is exact, only slower.
    """
    try:
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
    except Exception:  # no forward context: not called from a model forward
        return set(range(num_chunks))
    for per_layer in metadata if isinstance(metadata, list) else [metadata]:
        if not isinstance(per_layer, dict):
            continue
        for m in per_layer.values():
            if getattr(m, "cu_chunk_seqlen_p", None) is not cu_chunks:
                continue
            idx, meta = (
                getattr(m, "checkpoint_chunk_idx", None),
                getattr(m, "checkpoint_meta", None),
            )
            if idx is None or meta is None:
                return set()
            offsets = meta.offsets if meta.offsets is not None else meta.checkpoint_offsets.tolist()
            return {k for k, off in zip(idx.tolist(), offsets, strict=True) if off > 0}
    return set(range(num_chunks))


def store_prefill_checkpoint_cpu(
    checkpoint: Any,
    chunk_idx: torch.Tensor,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    chunk_states: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    state_len: int,
) -> None:
    """Write each checkpointing row's state at its checkpoint into its paged block.

    Same contract as vLLM's Triton ``store_prefill_checkpoint``: ``x`` is the pre-conv input
    ``(dim, tokens)``; the conv block's first ``state_len`` columns get the ``state_len``
    inputs before the checkpoint, oldest first; the SSM block gets ``chunk_states[chunk_idx]``.
    A row with offset 0 writes nothing. The scheduler only places a checkpoint at least one
    hash block into the query, so the conv window never reaches before the row.
    """
    offsets = checkpoint.offsets
    if offsets is None:
        offsets = checkpoint.checkpoint_offsets.tolist()
    dests = checkpoint.state_indices.tolist()
    starts = query_start_loc.tolist()
    chunks = chunk_idx.tolist()
    for row, off in enumerate(offsets):
        if off <= 0:
            continue
        end = starts[row] + off
        if off < state_len:
            raise ValueError(f"prefill checkpoint {off} tokens into row {row} < conv window")
        dst = dests[row]
        conv_state[dst, :, :state_len] = x[:, end - state_len : end]
        ssm_state[dst] = chunk_states[chunks[row]]


store_prefill_checkpoint_cpu._himamba_cpu_checkpoints = True  # type: ignore[attr-defined]
