"""vLLM general plugin: make hybrids with prefix caching exact on vLLM's CPU platform.

Three targeted fixes, each applied only on the CPU platform: Mamba2 prefill checkpoints, Mamba1's
missing prefill scan (Jamba), and the rotary embedding of 3-D query/key tensors (LFM2).

Mamba2 prefill checkpoints
--------------------------
In vLLM 0.32 (and, by source reading, 0.33) ``MambaMixer2.get_kv_cache_spec`` always returns a
``MambaSpec`` with ``num_prefill_checkpoint_blocks=1``. That promise tells the scheduler it may
let the last prefill chunk run past a block boundary: the model will export the SSM state *at*
the boundary from inside the chunk (chunk-scan with ``return_intermediate_states=True``, then
the Triton kernel ``store_prefill_checkpoint``). The CPU chunk-scan op ignores
``return_intermediate_states`` and returns only per-sequence final states, and there is no CPU
``store_prefill_checkpoint``. So any prompt whose last prefill chunk crosses a block boundary
(every prompt longer than one block, with ``mamba_cache_mode="align"``) dies in
``mamba_mixer2.py`` with ``IndexError: index N is out of bounds for dimension 0 with size 1``.

The fix: on the CPU platform only, give the mixer both missing pieces
(``cpu_mamba2_checkpoints``: a chunk scan that returns the states the mixer reads, and a torch
``store_prefill_checkpoint``), so the promise holds and CPU engines schedule prefills as GPU
engines do. Where that cannot be installed (a vLLM whose internals moved), or with
``HIMAMBA_CPU_MAMBA2_CHECKPOINTS=0``, the spec loses its checkpoint blocks instead: the
scheduler falls back to plain align mode, every prefill chunk ends on a block boundary (one
step more for a prompt whose last chunk crosses one), and the state at a chunk end is exactly
the cached state, which the CPU kernels do produce. Other Mamba-type layers (GDN, short-conv,
...) do not advertise checkpoint blocks and are left alone; GPU platforms are never touched.

Mamba1 prefill scan (Jamba)
---------------------------
vLLM's CPU build has no ``selective_scan_fwd`` op, so every prefill of a Mamba1 layer fails with
``AttributeError: '_OpNamespace' '_C' object has no attribute 'selective_scan_fwd'``.
``cpu_mamba1_scan`` supplies it in torch (installed once ``mamba_mixer`` is imported, and only
where the compiled op is missing).

Rotary embedding of 3-D query/key (LFM2 / ShortConv hybrids)
------------------------------------------------------------
Symptom: on CPU an ``Lfm2ForCausalLM`` generates different tokens for a prompt that extends a
cached prefix than for the same prompt computed cold, with vLLM's own prefix cache alone.
The short-conv state is not at fault: the conv state a chunk or decode step reads is exactly the
last ``L_cache - 1`` inputs of the tokens before it, at every prefix hit and chunk boundary.
The fault is the rotary embedding:

* ``Lfm2Attention.forward`` (``model_executor/models/lfm2.py``, and ``lfm2_moe.py``) applies
  its per-head q/k layernorms on ``[num_tokens, num_heads, head_size]`` views and hands those
  **3-D** tensors to ``self.rotary_emb``. Other models pass ``[num_tokens, num_heads *
  head_size]``.
* On CPU, ``RotaryEmbedding.forward_cpu`` (``layers/rotary_embedding/base.py``) calls the
  in-place C++ op ``rotary_embedding`` (``csrc/cpu/pos_encoding.cpp``), which only understands
  2-D: it takes ``num_heads = query.size(-1) / head_size`` (= 1 for 3-D) and the token stride
  ``query.stride(-2)`` (= ``head_size`` for 3-D). So for a batch of N tokens it rotates the
  first N head rows of the flattened ``[N * num_heads, head_size]`` tensor, row r with the
  position of token r, and leaves the other rows unrotated: with 4 query heads, the tokens at
  indices >= N/4 of the batch get no rotary embedding at all, and head h of token j < N/4 is
  rotated with the position of token 4j + h. Decode of one request rotates only head 0.

The result depends on how tokens are split into forward batches, so anything that changes the
batching changes the tokens: a prefix-cache hit (the hit request computes tokens 896..1023 as
a batch with a cached prefix; the cold one computes 0..1023 in one batch), chunked prefill
(``max_num_batched_tokens``), or other requests decoded in the same step. Repeating a prompt
exactly is "exact" only because the hit replays the cold run's last chunk with the same
batching. The CUDA kernel takes the head count from ``numel() / num_tokens`` and the token
stride from the token dimension, so GPUs are not affected.

The fix: on the CPU platform only, wrap ``RotaryEmbedding.forward_cpu`` so a query or key with
more than two dimensions goes to the kernel as a ``[num_tokens, heads * head_size]`` view of the
same memory (a copy, written back, if it is not viewable); 2-D callers take the original path
untouched. Subclasses that inherit ``forward_cpu`` (linear/NTK/YaRN/Llama-3 scaling ...) are
covered; those with their own ``forward_cpu`` (M-RoPE) are not touched.

Loading and switching off
-------------------------
vLLM imports general plugins in every process (API server, engine core, workers), so this
module imports nothing from vLLM at import time, and ``register()`` does not import the patched
modules either (``mamba_mixer2`` alone takes about 4.5 s on a 2-core CPU, wasted in processes
that never build a Mamba2 layer): a module not loaded yet is patched by a one-shot import hook
right after its first import. ``register()`` is idempotent, and a vLLM whose internals moved
(missing class, method or spec field) gets one log line and no patch rather than a crash.
``HIMAMBA_CPU_COMPAT=0`` turns the plugin off.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import ModuleType

    import torch
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.v1.kv_cache_interface import KVCacheSpec

_Spec = TypeVar("_Spec")

# A child of vLLM's logger, so our lines come out with vLLM's handler and format.
logger = logging.getLogger("vllm.himamba.cpu_compat")

ENV_DISABLE = "HIMAMBA_CPU_COMPAT"
ENV_NO_CHECKPOINTS = "HIMAMBA_CPU_MAMBA2_CHECKPOINTS"
MIXER2_MODULE = "vllm.model_executor.layers.mamba.mamba_mixer2"
MIXER1_MODULE = "vllm.model_executor.layers.mamba.mamba_mixer"
ROPE_MODULE = "vllm.model_executor.layers.rotary_embedding.base"
_PATCH_FLAG = "_himamba_cpu_compat"


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group ``himamba_cpu_compat``."""
    if not _env_on(ENV_DISABLE):
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
    pending = {}
    for module, patch in _patches().items():
        if module in sys.modules:
            patch()
        else:
            pending[module] = patch
    if pending and not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(pending))


def _patches() -> dict[str, Callable[[], bool]]:
    """Module name -> the function that patches it, for every fix this plugin applies."""
    return {
        MIXER2_MODULE: patch_mamba_mixer2,
        MIXER1_MODULE: patch_mamba1_scan,
        ROPE_MODULE: patch_cpu_rope,
    }


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Import hook: run a module's patch right after the module is first executed.

    It finds the real spec through the other finders and wraps only that module's
    ``exec_module``, so the module keeps its own loader (source lookups keep working). The hook
    leaves ``sys.meta_path`` once every module it waits for has been patched.
    """

    def __init__(self, pending: dict[str, Callable[[], bool]]) -> None:
        self.pending = dict(pending)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        patch = self.pending.get(fullname)
        if patch is None:
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

        def exec_module(module: ModuleType) -> None:
            inner_exec(module)
            self.pending.pop(fullname, None)
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                patch()
            except Exception as exc:  # never fail the import itself
                _log_once(f"patching {fullname} after import failed ({exc!r})")

        spec.loader.exec_module = exec_module
        return spec


def patch_mamba_mixer2() -> bool:
    """Make Mamba2's prefill checkpoints hold on CPU; return True when a fix is in place.

    First choice: export the checkpoints (``cpu_mamba2_checkpoints``). Fallback: wrap
    ``MambaMixer2.get_kv_cache_spec`` so the spec promises none.
    """
    try:
        from vllm.model_executor.layers.mamba import mamba_mixer2
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
    if _env_on(ENV_NO_CHECKPOINTS) and _export_checkpoints(mamba_mixer2):
        return True

    @functools.wraps(original)
    def get_kv_cache_spec(self: MambaMixer2, vllm_config: VllmConfig) -> KVCacheSpec | None:
        return without_prefill_checkpoints(original(self, vllm_config), MambaSpec)

    setattr(get_kv_cache_spec, _PATCH_FLAG, True)
    MambaMixer2.get_kv_cache_spec = get_kv_cache_spec
    logger.info(
        "himamba cpu_compat: Mamba2 prefill checkpoint blocks disabled on CPU "
        "(prefill chunks stay block-aligned)"
    )
    return True


def _export_checkpoints(mixer2_module: ModuleType) -> bool:
    """Install the CPU checkpoint export; False (logged) when this vLLM lacks its hooks."""
    from himamba.connector.vllm_fixups import cpu_mamba2_checkpoints

    try:
        done = cpu_mamba2_checkpoints.install(mixer2_module)
    except Exception as exc:
        _log_once(f"Mamba2 CPU checkpoint export not installed ({exc!r})")
        return False
    if not done:
        _log_once("this vLLM lacks the Mamba2 checkpoint hooks; checkpoint blocks disabled")
        return False
    logger.info("himamba cpu_compat: Mamba2 prefill checkpoints exported on CPU")
    return True


def without_prefill_checkpoints(spec: _Spec, mamba_spec_type: type) -> _Spec:
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


def patch_mamba1_scan() -> bool:
    """Give the CPU build Mamba1's prefill scan and decode step; True when in place."""
    from himamba.connector.vllm_fixups import cpu_mamba1_scan

    try:
        from vllm.model_executor.layers.mamba import mamba_mixer

        had = cpu_mamba1_scan.is_installed(mamba_mixer)
        done = cpu_mamba1_scan.install(mamba_mixer)
    except Exception as exc:
        _log_once(f"Mamba1 CPU prefill scan not installed ({exc!r})")
        return False
    if not done:
        _log_once("this vLLM lacks the Mamba1 ops this fix replaces; Mamba1 CPU scan not installed")
    elif not had and cpu_mamba1_scan.is_installed(mamba_mixer):
        logger.info("himamba cpu_compat: Mamba1 prefill scan (selective_scan_fwd) supplied on CPU")
    return done


def patch_cpu_rope() -> bool:
    """Wrap ``RotaryEmbedding.forward_cpu``; return True when the wrapper is in place."""
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    except Exception as exc:
        _log_once(f"vLLM layout differs ({exc!r}); CPU rotary embedding fix not applied")
        return False

    original = RotaryEmbedding.__dict__.get("forward_cpu")
    if original is None:
        _log_once(
            "RotaryEmbedding.forward_cpu is missing in this vLLM; CPU rotary embedding fix "
            "not applied"
        )
        return False
    if getattr(original, _PATCH_FLAG, False):
        return True

    @functools.wraps(original)
    def forward_cpu(
        self: RotaryEmbedding,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if query.dim() <= 2 and (key is None or key.dim() <= 2):
            return original(self, positions, query, key)
        return rope_on_token_rows(
            lambda q, k: original(self, positions, q, k), positions.numel(), query, key
        )

    setattr(forward_cpu, _PATCH_FLAG, True)
    RotaryEmbedding.forward_cpu = forward_cpu
    logger.info(
        "himamba cpu_compat: CPU rotary embedding gets 3-D query/key as [tokens, heads * "
        "head_size] (the CPU kernel reads only that layout)"
    )
    return True


def rope_on_token_rows(
    apply: Callable[[torch.Tensor, torch.Tensor | None], object],
    num_tokens: int,
    query: torch.Tensor,
    key: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the in-place rotary op ``apply(q, k)`` on ``[num_tokens, -1]`` views of ``query`` and
    ``key`` and return them in their own shapes.

    A tensor that cannot be viewed that way (non-contiguous heads) goes through a contiguous
    copy that is written back, so the caller sees the same in-place result either way.
    """
    q2, q_copied = _token_rows(query, num_tokens)
    k2, k_copied = _token_rows(key, num_tokens) if key is not None else (None, False)
    apply(q2, k2)
    if q_copied:
        query.copy_(q2.view(query.shape))
    if k_copied:
        key.copy_(k2.view(key.shape))
    return query, key


def _token_rows(t: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, bool]:
    """``t`` as ``[num_tokens, -1]`` with a unit last stride: a view when possible, else a copy
    (second item True)."""
    if t.dim() <= 2 and t.stride(-1) == 1:
        return t, False
    try:
        rows = t.view(num_tokens, -1)
    except RuntimeError:
        return t.reshape(num_tokens, -1).contiguous(), True
    if rows.stride(-1) != 1:
        return rows.contiguous(), True
    return rows, False


def is_rope_patched() -> bool:
    """True when ``RotaryEmbedding.forward_cpu`` carries this plugin's wrapper."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    return bool(getattr(RotaryEmbedding.__dict__.get("forward_cpu"), _PATCH_FLAG, False))


def is_patched() -> bool:
    """True when Mamba2's checkpoints are fixed on CPU: exported, or dropped from the spec."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    wrapped = getattr(MambaMixer2.__dict__.get("get_kv_cache_spec"), _PATCH_FLAG, False)
    return bool(wrapped) or is_exporting_checkpoints()


def _env_on(name: str) -> bool:
    """A switch that is on unless set to 0 / false / no / off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def is_exporting_checkpoints() -> bool:
    """True when Mamba2 prefill checkpoints are exported on CPU (the spec is left as is)."""
    from vllm.model_executor.layers.mamba import mamba_mixer2

    from himamba.connector.vllm_fixups import cpu_mamba2_checkpoints

    spec_method = mamba_mixer2.MambaMixer2.__dict__.get("get_kv_cache_spec")
    return cpu_mamba2_checkpoints.is_installed(mamba_mixer2) and not getattr(
        spec_method, _PATCH_FLAG, False
    )


def _has_field(cls: type, name: str) -> bool:
    import dataclasses

    if dataclasses.is_dataclass(cls):
        return any(f.name == name for f in dataclasses.fields(cls))
    return hasattr(cls, name)


@functools.cache
def _log_once(message: str) -> None:
    logger.warning("himamba cpu_compat: %s", message)
