"""Storage control at run time: attach, detach or inspect the storage tier without a restart.

vLLM's convention for run-time operations on a serving engine is ``collective_rpc`` on a worker
extension (``--worker-extension-cls``, what RL frameworks use to swap weights): offline through
``LLM.collective_rpc`` and on the server through the ``/collective_rpc`` endpoint
(``VLLM_SERVER_DEV_MODE=1``). A connector has no other way in: the scheduler is reachable only
through engine hooks. So the call lands on every worker, each worker switches its own store at
once, and tells the scheduler half through its per-step metadata; the scheduler half switches
at the next engine step. Clearing the tiers needs no new surface: vLLM's
``reset_prefix_cache(reset_connector=True)`` (``/reset_prefix_cache?reset_external=true``).

Actions are idempotent (every rank reports the same one, possibly in different steps):
``attach_storage`` (the configured ``storage`` section, or a new one given as ``storage``),
``detach_storage`` (stop probing, fetching and writing; pending writes are flushed), ``status``.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any


class ControlAction(str, enum.Enum):
    ATTACH = "attach_storage"
    DETACH = "detach_storage"
    STATUS = "status"


@dataclass(frozen=True)
class ControlRequest:
    """Worker -> scheduler: switch storage (``storage_json``: the section to attach, "" for the
    configured one)."""

    action: ControlAction
    storage_json: str = ""

    def storage(self) -> dict[str, Any] | None:
        return json.loads(self.storage_json) if self.storage_json else None


def parse_action(action: str) -> ControlAction:
    try:
        return ControlAction(action)
    except ValueError:
        known = ", ".join(a.value for a in ControlAction)
        raise ValueError(f"himamba_control: unknown action {action!r}; one of: {known}") from None


class HiMambaWorkerExtension:
    """Mixed into vLLM's worker class with ``--worker-extension-cls
    himamba.connector.control.HiMambaWorkerExtension``; then
    ``collective_rpc("himamba_control", args=("detach_storage",))`` (or ``attach_storage`` with an
    optional storage section as the second argument, or ``status``) runs on every worker."""

    def himamba_control(self, action: str, storage: dict[str, Any] | str | None = None) -> dict:
        """``storage``: a storage section, or that section as a JSON string (vLLM's HTTP
        ``/collective_rpc`` passes only strings)."""
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        from himamba.connector.vllm_connector import HiMambaConnector

        connector = get_kv_transfer_group() if has_kv_transfer_group() else None
        if not isinstance(connector, HiMambaConnector):
            raise RuntimeError("himamba_control: this engine does not run the HiMambaConnector")
        if isinstance(storage, str):
            try:
                storage = json.loads(storage) if storage.strip() else None
            except json.JSONDecodeError as exc:
                raise ValueError(f"himamba_control: storage is not valid JSON: {exc.msg}") from None
        if storage is not None and not isinstance(storage, dict):
            raise ValueError("himamba_control: storage must be a mapping (the storage section)")
        return connector.control(parse_action(action), storage)
