"""The batched pointer-list copy that ``CudaCopyEngine`` drives, on a GPU machine without vLLM.

On a GPU the copy engine hands ``CopyPlan.pointer_lists()`` to vLLM's
``_custom_ops.swap_blocks_batch`` (one ``cuMemcpyBatchAsync`` on the current stream). A GPU
machine used for checks may have CUDA torch but no vLLM; then the engine falls back to torch
slice copies and the pointer lists, the production path, go untested. This module calls the
same driver entry point through ctypes so the GPU tests and ``bench_transfer`` exercise the
pointer lists against real device and pinned memory. Test and benchmark support only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes``: source access order, two location hints, flags."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


def _driver_batch_op() -> Callable[..., None] | None:
    """``cuMemcpyBatchAsync`` (v2 on CUDA 13 drivers, v1 with ``failIdx`` on 12.8+)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = getattr(lib, "cuMemcpyBatchAsync_v2", None)
    with_fail_idx = fn is None
    if fn is None:
        fn = getattr(lib, "cuMemcpyBatchAsync", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)

    def op(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor) -> None:
        n = src.numel()
        if n == 0:
            return
        arr = ctypes.c_uint64 * n
        srcs, dsts = arr(*src.tolist()), arr(*dst.tolist())
        lens = (ctypes.c_size_t * n)(*sizes.tolist())
        idx = ctypes.c_size_t(0)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        args: list[object] = [dsts, srcs, lens, ctypes.c_size_t(n), ctypes.byref(attrs)]
        args += [ctypes.byref(idx), ctypes.c_size_t(1)]
        if with_fail_idx:
            args.append(ctypes.byref(ctypes.c_size_t(0)))
        rc = fn(*args, stream)
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc}")

    return op


def batched_copy_op() -> tuple[Callable[..., None] | None, str]:
    """(op, name): vLLM's own op where vLLM has it (what the engine picks by itself), else
    the driver's through ctypes."""
    from himamba.tiers.transfer_cuda import _batched_copy_op  # noqa: PLC0415

    op = _batched_copy_op()
    if op is not None:
        return op, "vllm"
    op = _driver_batch_op()
    return (op, "cuMemcpyBatchAsync via ctypes") if op is not None else (None, "none")
