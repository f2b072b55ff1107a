"""A step-start hook for vLLM's Model Runner V2, which writes blocks before any connector hook.

Model Runner V1 (what vLLM's CPU platform runs) calls the connector's ``handle_preemptions``
first thing in a step. V2 (``vllm/v1/worker/gpu``, a GPU engine's default where Triton is
present, in vLLM 0.32 and 0.33) first applies the scheduler's output: it zeroes the blocks the
step hands out, applies copy-on-write block copies and moves Mamba states into new blocks,
and only then calls ``handle_preemptions`` from ``pre_forward``. Two things of ours must come
before those writes: the fence of a CPU copy engine's stores (they may still read a block the
step hands out) and partial tails' copies (``StepPlan.early_stores``: blocks vLLM freed when the
last output came in, handed out first since vLLM reuses uncached blocks LIFO).

So, in the worker process, V2's ``execute_model`` is wrapped to call the active connector's
``himamba_step_start`` with the step's metadata before vLLM's own body runs (dummy runs
excepted). Where it cannot be installed (a vLLM whose V2 runner moved), or with
``HIMAMBA_V2_STEP_HOOK=0``, the connector falls back to what is safe without it: CPU stores
finish within their own step, and the scheduler drops tails whose blocks the step hands out.
The scheduler process asks ``step_hook_available`` (the same checks, without patching) so both
processes take the same side.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any

logger = logging.getLogger("himamba")

ENV = "HIMAMBA_V2_STEP_HOOK"
_MARK = "_himamba_step_start"


def _target() -> tuple[type, int] | None:
    """V2's runner class and the position of ``dummy_run`` among ``execute_model``'s arguments
    after ``scheduler_output``, if its shape is the one this hook knows."""
    if os.environ.get(ENV, "1") == "0":
        return None
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001 - no V2 runner in this vLLM (or it cannot import here)
        return None
    method = getattr(GPUModelRunner, "execute_model", None)
    if method is None:
        return None
    params = list(inspect.signature(getattr(method, "__wrapped__", method)).parameters)
    if params[:2] != ["self", "scheduler_output"] or "dummy_run" not in params:
        return None
    return GPUModelRunner, params.index("dummy_run") - 2


def step_hook_available() -> bool:
    """Would ``install_step_hook`` succeed in a worker of this vLLM (checked, not installed)?"""
    return _target() is not None


def install_step_hook() -> bool:
    """Wrap V2's ``execute_model`` once per process; True if it is (now or already) wrapped."""
    target = _target()
    if target is None:
        return False
    cls, dummy_at = target
    original = cls.execute_model
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        dummy = kwargs.get("dummy_run", args[dummy_at] if len(args) > dummy_at else False)
        if not dummy:
            step_start(getattr(scheduler_output, "kv_connector_metadata", None))
        return original(self, scheduler_output, *args, **kwargs)

    setattr(execute_model, _MARK, True)
    cls.execute_model = execute_model
    logger.info("himamba: Model Runner V2 step-start hook installed (%s=0 turns it off)", ENV)
    return True


def step_start(metadata: Any) -> None:
    """Hand this step's metadata to every HiMamba connector of the worker's KV-transfer group
    (vLLM's MultiConnector included) before the runner writes any block."""
    if metadata is None:
        return
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        _dispatch(get_kv_transfer_group(), metadata)


def _dispatch(connector: Any, metadata: Any) -> None:
    hook = getattr(connector, "himamba_step_start", None)
    if hook is not None:
        hook(metadata)
        return
    children = getattr(connector, "_connectors", None)  # vLLM's MultiConnector
    metas = getattr(metadata, "metadata", None)
    if children and metas is not None:
        for child, meta in zip(children, metas, strict=False):
            _dispatch(child, meta)
