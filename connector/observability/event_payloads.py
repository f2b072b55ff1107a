"""Payloads of our KV events: a block as a router sees it, and how events of a step are merged.

They follow vLLM's GPU events for the same groups: hashes of whole scheduler blocks (the last
hash-block hash inside each, as vLLM's ``BlockHashListWithBlockSize`` does), ``block_size`` =
the scheduler block size, the block's ``token_ids``, parent hash, LoRA and extra keys; a block
nobody can describe any more goes out as ``token_ids=[]``, ``block_size=0``, no parent (what
vLLM's offloading connector sends for payloads it cannot describe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(slots=True)
class BlockPayload:
    """A scheduler block as a router sees it: its hash, its parent's, its tokens."""

    block_hash: bytes
    parent: bytes | None = None
    token_ids: list[int] | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None

    @property
    def described(self) -> bool:
        return bool(self.token_ids)


def describe_block(request: Request, index: int, block_size: int, per_block: int) -> BlockPayload:
    """Block ``index`` of ``request`` (``per_block`` hash blocks per scheduler block)."""

    def block_hash(i: int) -> bytes:
        return request.block_hashes[(i + 1) * per_block - 1]

    lora = getattr(request, "lora_request", None)
    start, end = index * block_size, (index + 1) * block_size
    return BlockPayload(
        block_hash=block_hash(index),
        parent=block_hash(index - 1) if index > 0 else None,
        token_ids=list(request.all_token_ids[start:end]),
        lora_id=None if lora is None else lora.adapter_id,
        lora_name=None if lora is None else lora.name,
        extra_keys=_extra_keys(request, start, end),
    )


def merge_events(events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """Fold each event into the previous one of the same (type, medium, group, owner) when it
    continues it: a store whose parent is the last hash stored, a removal after a removal.
    Only the latest event of each stream is extended, so order within a stream is kept."""
    out: list[KVCacheEvent] = []
    last: dict[tuple[Any, ...], int] = {}
    for ev in events:
        stream = (
            getattr(ev, "medium", None),
            getattr(ev, "group_idx", None),
            getattr(ev, "ownership", None),
        )
        j = last.get(stream)
        prev = out[j] if j is not None else None
        if isinstance(ev, BlockStored) and isinstance(prev, BlockStored) and _chains(prev, ev):
            prev.block_hashes.extend(ev.block_hashes)
            prev.token_ids.extend(ev.token_ids)
            if prev.extra_keys is not None and ev.extra_keys is not None:
                prev.extra_keys.extend(ev.extra_keys)
            continue
        if isinstance(ev, BlockRemoved) and isinstance(prev, BlockRemoved):
            prev.block_hashes.extend(ev.block_hashes)
            continue
        last[stream] = len(out)
        out.append(ev)
    return out


def _chains(prev: BlockStored, ev: BlockStored) -> bool:
    return (
        prev.block_size > 0
        and ev.block_size == prev.block_size
        and ev.parent_block_hash == prev.block_hashes[-1]
        and (ev.lora_id, ev.lora_name) == (prev.lora_id, prev.lora_name)
        and (ev.extra_keys is None) == (prev.extra_keys is None)
    )


def _extra_keys(request: Request, start: int, end: int) -> list[Any] | None:
    """The block's untagged extra keys (cache salt, LoRA, multimodal), as vLLM publishes."""
    try:
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            to_event_extra_keys,
        )

        keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
        return to_event_extra_keys([keys])
    except (ImportError, AttributeError, TypeError):  # a stand-in request, or another vLLM
        return None
