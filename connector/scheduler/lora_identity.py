"""The identity of a LoRA adapter's *weights*, for storage keys.

vLLM's block hashes carry an adapter's name and path, not its weights: two instances sharing
storage, serving different versions of an adapter under one name (or one path re-pointed at
new files), would read each other's KV. The tag is a fingerprint of the adapter's files (the
same sampled fingerprint as the model's weights), computed once per adapter per process and
folded into the storage key (``protocol.key_salt``). Within one process the tree already
keeps adapters apart (its partitions carry the adapter id).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from himamba.connector.weights_identity import fingerprint_checkpoint

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# A tag is part of every key of the adapter's objects: short, but collision-free in practice.
TAG_HEX = 16


class LoraTags:
    """``lora_int_id -> tag`` for the adapters this scheduler has seen."""

    def __init__(self, mode: str = "sampled") -> None:
        self.mode = mode
        self._tags: dict[int, str] = {}

    def tag(self, lora_request: LoRARequest | None) -> str:
        """The request's adapter tag; "" without LoRA."""
        if lora_request is None:
            return ""
        lora_id = int(lora_request.lora_int_id)
        tag = self._tags.get(lora_id)
        if tag is None:
            tag = self._tags[lora_id] = self._fingerprint(lora_request)
        return tag

    def tag_of_id(self, lora_id: int | None) -> str:
        """The tag of an adapter seen before (tree partitions name adapters by id)."""
        return "" if lora_id is None else self._tags.get(lora_id, "")

    def _fingerprint(self, lora_request: LoRARequest) -> str:
        path = Path(str(getattr(lora_request, "lora_path", "") or ""))
        h = hashlib.blake2b(digest_size=TAG_HEX // 2)
        try:
            h.update(fingerprint_checkpoint(path, self.mode).encode())
            config = path / "adapter_config.json"  # rank, alpha, targets change the output too
            if config.is_file():
                h.update(config.read_bytes())
        except (OSError, ValueError) as exc:
            # Not a local directory (vLLM resolved it elsewhere): the name and path are all
            # there is; say so once, since versions behind one path are then indistinguishable.
            logger.warning(
                "himamba: LoRA adapter %r: cannot fingerprint %s (%s); storage keys carry its "
                "name and path only",
                getattr(lora_request, "lora_name", "?"),
                path,
                exc,
            )
            h.update(f"{getattr(lora_request, 'lora_name', '')}\0{path}".encode())
        return h.hexdigest()
