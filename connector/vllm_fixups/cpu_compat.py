"""vLLM general plugin: let Mamba2 hybrids run with prefix caching on vLLM's CPU platform.

Why this exists
---------------
In vLLM 0.32 (and, by source reading, 0.33) ``MambaMixer2.get_kv_cache_spec`` always returns a
``MambaSpec`` with ``num_prefill_checkpoint_blocks=1``. That promise tells the scheduler it may
let the last prefill chunk run past a block boundary: the model will export the SSM state *at*
the boundary from inside the chunk (chunk-scan with ``return_intermediate_states=True``, then
the Triton kernel ``store_prefill_checkpoint``). The CPU chunk-scan op ignores
``return_intermediate_states`` and returns only per-sequence final states, and there is no CPU
``store_prefill_checkpoint``. So any prompt whose last prefill chunk crosses a block boundary
(every prompt longer than one block, with ``mamba_cache_mode="align"``) dies in
``mamba_mixer2.py`` with ``IndexError: index N is out of bounds for dimension 0 with size 1``.

The fix
-------
On the CPU platform only, wrap ``MambaMixer2.get_kv_cache_spec`` so the spec carries no
prefill checkpoint blocks. The scheduler then falls back to plain align mode: every prefill
chunk ends on a block boundary, and the state at a chunk end is exactly the cached state, which
the CPU kernels do produce. Other Mamba-type layers (GDN, short-conv, ...) do not advertise
checkpoint blocks and are left alone; GPU platforms are never touched.

vLLM imports general plugins in every process (API server, engine core, workers), so this
module imports nothing from vLLM at import time, and ``register()`` does not import
``mamba_mixer2`` either (about 4.5 s on a 2-core CPU, wasted in processes that never build a
Mamba2 layer): when the module is not loaded yet, a one-shot import hook patches it right after
its first import. ``register()`` is idempotent, and a vLLM whose internals moved (missing
class, method or spec field) gets one log line and no patch rather than a crash.
``HIMAMBA_CPU_COMPAT=0`` turns the plugin off.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import sys
from typing import Any

# A child of vLLM's logger, so our lines come out with vLLM's handler and format.
logger = logging.getLogger("vllm.himamba.cpu_compat")

ENV_DISABLE = "HIMAMBA_CPU_COMPAT"
MIXER2_MODULE = "vllm.model_executor.layers.mamba.mamba_mixer2"
_PATCH_FLAG = "_himamba_cpu_compat"


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group ``himamba_cpu_compat``."""
    if os.environ.get(ENV_DISABLE, "1").strip().lower() in ("0", "false", "no", "off"):
        logger.debug("himamba cpu_compat disabled by %s", ENV_DISABLE)
        return
    try:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    except Exception as exc:  # a plugin must never break vLLM start-up
        _log_once(f"cannot determine the vLLM platform ({exc!r}); not patching")
        return
    if not on_cpu:
        return
    if MIXER2_MODULE in sys.modules:
        patch_mamba_mixer2()
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Import hook: run ``patch_mamba_mixer2`` right after ``mamba_mixer2`` is first executed.

    It finds the real spec through the other finders and wraps only that module's
    ``exec_module``, so the module keeps its own loader (source lookups keep working).
    """

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != MIXER2_MODULE:
            return None
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        inner_exec = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            inner_exec(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                patch_mamba_mixer2()
            except Exception as exc:  # never fail the import itself
                _log_once(f"patching after import failed ({exc!r})")

        spec.loader.exec_module = exec_module
        return spec


def patch_mamba_mixer2() -> bool:
    """Wrap ``MambaMixer2.get_kv_cache_spec``; return True when the wrapper is in place."""
    try:
        from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
        from vllm.v1.kv_cache_interface import MambaSpec
    except Exception as exc:
        _log_once(f"vLLM layout differs ({exc!r}); Mamba2 CPU checkpoint fix not applied")
        return False

    original = MambaMixer2.__dict__.get("get_kv_cache_spec")
    if original is None or not _has_field(MambaSpec, "num_prefill_checkpoint_blocks"):
        _log_once(
            "MambaMixer2.get_kv_cache_spec or MambaSpec.num_prefill_checkpoint_blocks is "
            "missing in this vLLM; Mamba2 CPU checkpoint fix not applied"
        )
        return False
    if getattr(original, _PATCH_FLAG, False):
        return True

    @functools.wraps(original)
    def get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
        return without_prefill_checkpoints(original(self, vllm_config), MambaSpec)

    setattr(get_kv_cache_spec, _PATCH_FLAG, True)
    MambaMixer2.get_kv_cache_spec = get_kv_cache_spec
    logger.info(
        "himamba cpu_compat: Mamba2 prefill checkpoint blocks disabled on CPU "
        "(prefill chunks stay block-aligned)"
    )
    return True


def without_prefill_checkpoints(spec: Any, mamba_spec_type: type) -> Any:
    """Return ``spec`` without prefill checkpoint blocks; any other spec comes back as is."""
    if not isinstance(spec, mamba_spec_type):
        return spec
    if not getattr(spec, "num_prefill_checkpoint_blocks", 0):
        return spec
    import dataclasses

    try:
        return dataclasses.replace(
            spec, num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None
        )
    except (TypeError, ValueError) as exc:
        _log_once(f"cannot rewrite MambaSpec ({exc!r}); leaving it unchanged")
        return spec


def is_patched() -> bool:
    """True when ``MambaMixer2.get_kv_cache_spec`` carries this plugin's wrapper."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    return bool(getattr(MambaMixer2.__dict__.get("get_kv_cache_spec"), _PATCH_FLAG, False))


def _has_field(cls: type, name: str) -> bool:
    import dataclasses

    if dataclasses.is_dataclass(cls):
        return any(f.name == name for f in dataclasses.fields(cls))
    return hasattr(cls, name)


@functools.cache
def _log_once(message: str) -> None:
    logger.warning("himamba cpu_compat: %s", message)
