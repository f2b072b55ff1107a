"""Storage control at run time: attach, detach or inspect the storage tier without a restart.

vLLM's convention for run-time operations on a serving engine is ``collective_rpc`` on a worker
extension (``--worker-extension-cls``, what RL frameworks use to swap weights): offline through
``LLM.collective_rpc`` and on the server through the ``/collective_rpc`` endpoint
(``VLLM_SERVER_DEV_MODE=1``). A connector has no other way in: the scheduler is reachable only
through engine hooks. So the call lands on every worker; each worker starts its own switch and,
once its new store is live, tells the scheduler half through its per-step metadata; the
scheduler half then switches too. The call runs on the engine loop, between two steps, so it
only starts the slow work (``storage_switch``: stores are opened and closed in the background)
and answers at once. Clearing the tiers needs no new surface: vLLM's
``reset_prefix_cache(reset_connector=True)`` (``/reset_prefix_cache?reset_external=true``).

Actions are idempotent (every rank reports the same one, possibly in different steps), and each
returns every rank's status:

* ``attach_storage``: the configured ``storage`` section, or a new one given as ``storage``.
  A section with an error is refused at once (the call fails, naming the field); otherwise
  the status says ``attaching`` until the store is open and live on that rank (``attached``),
  or the attach was refused (``error``: the store could not be opened; the rank keeps the
  store it had).
* ``detach_storage``: stop probing, fetching and writing at once; pending writes are flushed
  while the old store closes in the background.
* ``status``: per rank ``storage`` (``attached`` / ``attaching`` / ``detached``), ``target``
  (the store, password hidden), ``scheduler`` (the scheduler half's storage as of the last
  step: ``attached`` / ``detached``, or ``switching`` until it follows this rank's last
  switch) and ``error`` (this rank's last refused attach).
"""

from __future__ import annotations

import json
from typing import Any

from himamba.connector.protocol import ControlAction


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
