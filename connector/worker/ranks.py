"""Which worker this process is, for per-rank storage keys and fetch acknowledgements."""

from __future__ import annotations


def worker_rank() -> int:
    """This worker's tensor-parallel rank: it names the shard the worker stores and reads, and
    identifies its fetch acknowledgements (PP and DCP are refused by the layout, so within one
    engine the TP rank is unique; data-parallel replicas with equal TP ranks share shards).

    0 when no distributed group exists (a single in-process worker). Tests that simulate several
    workers in one process replace this function around each worker connector's construction.
    """
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no process group: one worker
        return 0
