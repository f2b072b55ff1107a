"""The device (vLLM) block ids a store run copies from, read without copying whole tables.

vLLM offers a producer connector ``KVConnectorBlockState.get_block_ids(req_id)``: every KV
cache group's whole block list of the request, built as new lists on each call (~10 us for a
4k-token request of the tests' hybrid). A store run needs only its attention groups and only
the blocks ``[start, end)`` it stores, several runs a step while prompts are admitted. The
block lists behind that call are the KV cache manager's own (``coordinator.single_type_managers
[g].req_to_blocks``), so this reads those slices directly.

That reaches into vLLM's internals, which may move between releases. So the direct read is
used only where its shape is found, its first answers are checked against the public call,
and any mismatch or missing attribute switches it off for good (logged once): the public call
is then the only source, exactly as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import KVConnectorBlockState

logger = logging.getLogger(__name__)

# How many direct reads are compared with vLLM's public call before the direct path is
# trusted on its own.
CHECKED_READS = 16


class DeviceBlockIds:
    """Per attention group, the device block ids of a request's blocks ``[start, end)``."""

    def __init__(self, attention_groups: Sequence[int]) -> None:
        self.groups = list(attention_groups)
        self.direct = True  # until its shape is missing or an answer differs
        self._checks_left = CHECKED_READS

    def rows(
        self, block_state: KVConnectorBlockState, req_id: str, start: int, end: int
    ) -> list[list[int]] | None:
        """Rows indexed from ``start`` (may be shorter than ``end - start`` where vLLM has
        fewer blocks); None when vLLM offers no block table for the request this step."""
        if self.direct:
            rows = self._direct(block_state, req_id, start, end)
            if self.direct and self._checks_left:
                self._checks_left -= 1
                if rows != self._public(block_state, req_id, start, end):
                    self._switch_off("a direct read of vLLM's block table differed from it")
            if self.direct:
                return rows
        return self._public(block_state, req_id, start, end)

    def _public(
        self, block_state: KVConnectorBlockState, req_id: str, start: int, end: int
    ) -> list[list[int]] | None:
        ids = block_state.get_block_ids(req_id)
        if ids is None:
            return None
        return [ids[g][start:end] for g in self.groups]

    def _direct(
        self, block_state: Any, req_id: str, start: int, end: int
    ) -> list[list[int]] | None:
        try:
            if req_id not in block_state.req_ids:
                return None
            managers = block_state.resolve_block_ids.__self__.coordinator.single_type_managers
            out = []
            for g in self.groups:
                blocks = managers[g].req_to_blocks.get(req_id) or ()
                out.append([b.block_id for b in blocks[start:end]])
            return out
        except (AttributeError, IndexError, TypeError) as exc:
            self._switch_off(f"vLLM's block tables are not where expected ({exc!r})")
            return None

    def _switch_off(self, why: str) -> None:
        if self.direct:
            logger.warning("himamba: %s; using vLLM's get_block_ids from now on", why)
        self.direct = False
