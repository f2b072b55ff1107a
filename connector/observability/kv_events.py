"""KV-cache events for routers: what enters and leaves the CPU tier and storage.

vLLM publishes what its GPU cache holds as ``BlockStored`` / ``BlockRemoved`` events (medium
``"GPU"``); KV-aware routers (llm-d, Dynamo, the production stack) route by them. These are the
same events for our tiers, published by vLLM's own publisher (``--kv-events-config``) through the
scheduler connector's ``take_events``:

* medium ``"CPU"`` (vLLM's ``MEDIUM_CPU``): the host tier. Stored when a block's or state's
  bytes are committed to a host slot, removed when the slot is freed (LRU eviction, the
  prefix cascade, a replaced decode state, reset). Exact: driven by the tree itself
  (``HybridRadixTree.set_observer``), not by our guess of it.
* the storage kind (``storage_medium``): ``"DISK"`` (file adapters), ``"REDIS"`` (RESP),
  otherwise the adapter type in capitals (``"S3"``, ...). Stored once *every* TP rank's write
  of the object succeeded (each rank holds a shard; a block is loadable only if all are
  there), removed when any rank evicted it for ``capacity_gb`` or found it missing or invalid.
  The workers see these outcomes; they travel to the scheduler as ``HiMambaWorkerEvents``
  (vLLM's worker-events channel) and are turned into vLLM events there.

Payloads follow vLLM's GPU events for the same groups: one event per KV cache group
(``group_idx``, ``kv_cache_spec_kind``), hashes of whole scheduler blocks (the last hash-block
hash inside each, as vLLM's ``BlockHashListWithBlockSize`` does), ``block_size`` = the scheduler
block size, the block's ``token_ids``, parent hash, LoRA and extra keys. Consecutive blocks of a
chain are merged into one event per group and medium. A Mamba state at boundary ``n`` is
announced as the Mamba group's block ``n - 1`` (what vLLM's GPU cache announces for the same
state in align mode): a router that wants hybrid hits needs both halves.

Where the request is not at hand, token ids are not invented:
* a block fetched from storage into the CPU tier is announced when a request loads it (the
  request then is at hand); one never loaded is never announced, and its removal is silent;
* storage writes of ``write_through`` carry the payload captured when the block was stored to
  the CPU tier; ``write_through_selective`` / ``write_back`` writes happen long after, so they
  are announced like vLLM's offloading connector announces payloads it cannot describe:
  ``token_ids=[]``, ``block_size=0``, no parent.
Removals need only hashes. Consumers should treat stores and removals idempotently (a TP rank's
late removal of an object another rank already reported repeats it), as vLLM asks of
consumers of its offloading events.

Resets: a connector reset (``reset_cache``) removes every CPU block through ``BlockRemoved``; the
storage objects it makes unreachable (a new key epoch) get no per-block removal, since nothing
here lists what storage holds. vLLM's own ``AllBlocksCleared`` accompanies every prefix-cache
reset; it comes from its GPU pool, and after a GPU-only reset our tiers still hold their blocks.

Cost: nothing exists unless events are enabled with a real publisher (``events_enabled``); the
tree's observer slot is then None and the halves skip every call with one attribute test.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from himamba.tiers.object_format import KV_OBJECT as KV
from himamba.tiers.object_format import MAMBA_OBJECT as MAMBA

# Storage media by LMCache L2 adapter type; anything else is announced as its type in capitals.
_STORAGE_MEDIA = {"fs": "DISK", "fs_native": "DISK", "resp": "REDIS", "redis": "REDIS"}


def storage_medium(adapter: dict[str, Any] | None) -> str:
    """The ``medium`` of our storage tier's events, from the adapter spec (``StorageConfig``)."""
    kind = str((adapter or {}).get("type", "storage"))
    return _STORAGE_MEDIA.get(kind, kind.upper())


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM will publish connector events (enabled, with a publisher that sends)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(
        cfg is not None
        and getattr(cfg, "enable_kv_cache_events", False)
        and getattr(cfg, "publisher", "null") not in (None, "null")
    )


def group_kinds(layout: Any, kv_cache_config: Any) -> dict[int, str]:
    """``kv_cache_spec_kind`` of every group we cache, as vLLM's own events name it."""
    out = {g.group_id: "full_attention" for g in layout.attention}
    out.update({g.group_id: "mamba" for g in layout.mamba})
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind
    except ImportError:  # pragma: no cover - older vLLM: the defaults above
        return out
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    for gid in out:
        if gid < len(groups):
            out[gid] = get_kv_cache_spec_kind(groups[gid].kv_cache_spec).value
    return out


# -- worker -> scheduler -------------------------------------------------------------------


class StorageOp(enum.IntEnum):
    WRITTEN = 0  # this rank's shard of the object is in storage
    WRITE_FAILED = 1  # this rank's write failed or was skipped: the object is incomplete
    REMOVED = 2  # this rank's shard is gone (capacity eviction) or unusable (missing, invalid)


class StorageOutcome(NamedTuple):
    """One storage fact a worker saw (plain values: it is pickled to the scheduler)."""

    op: StorageOp
    rank: int
    kind: int  # KV or MAMBA
    block_hash: bytes
    epoch: str


class HiMambaWorkerEvents(KVConnectorKVEvents):
    """Worker storage outcomes of one step, on vLLM's worker-events channel.

    vLLM's ``KVOutputAggregator`` only concatenates them across TP workers; the scheduler
    connector picks them up in ``update_connector_output`` and turns them into vLLM events
    (``KVEventTracker.absorb``): they are never published as they are."""

    def __init__(self, outcomes: list[StorageOutcome] | None = None) -> None:
        self.outcomes: list[StorageOutcome] = list(outcomes or ())
        self.workers = 1

    def add_events(self, events: list[Any]) -> None:
        self.outcomes.extend(events)

    def aggregate(self) -> HiMambaWorkerEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.outcomes)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.outcomes.clear()


# -- scheduler side ------------------------------------------------------------------------


@dataclass(slots=True)
class _Block:
    """A scheduler block as a router sees it: its hash, its parent's, its tokens."""

    block_hash: bytes
    parent: bytes | None
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[Any] | None


@dataclass(slots=True)
class _Write:
    """A storage write some ranks acknowledged; announced when all did."""

    block: _Block | None
    ranks: set[int] = field(default_factory=set)


class KVEventTracker:
    """Scheduler-side source of our KV events (see the module doc for what and when).

    It is the tree's observer (``host_kv`` / ``host_state``); the scheduler half tells it what
    it plans to store (``planned_kv`` / ``planned_state``, with the request) and what a request
    loads (``loaded``); the connector feeds it the workers' storage outcomes (``absorb``) and
    drains it once per step (``take``)."""

    def __init__(
        self,
        layout: Any,
        kinds: dict[int, str],
        storage_medium: str | None = None,
        world_size: int = 1,
        write_through: bool = False,
        max_pending_writes: int = 65536,
    ) -> None:
        self.block_size = layout.block_size
        self._per_block = layout.hashes_per_block
        self._groups = {
            KV: [(g.group_id, kinds[g.group_id]) for g in layout.attention],
            MAMBA: [(g.group_id, kinds[g.group_id]) for g in layout.mamba],
        }
        self.storage_medium = storage_medium
        self.world_size = world_size
        self.write_through = write_through and storage_medium is not None
        self._max_writes = max_pending_writes
        # Stores planned this step: hash -> (request, block index); committed (or not) by the
        # tree within the same step, so whatever is left at ``take`` is dropped.
        self._planned: dict[int, dict[bytes, tuple[Any, int]]] = {KV: {}, MAMBA: {}}
        # Host objects that came from storage and that no request has loaded yet: announced
        # when one does (the request gives the tokens); removed silently if none ever does.
        self._unannounced: dict[int, set[bytes]] = {KV: set(), MAMBA: set()}
        self._writes: OrderedDict[tuple[int, bytes], _Write] = OrderedDict()
        self._queue: list[KVCacheEvent] = []

    # -- what the scheduler half tells us ------------------------------------------------
    def planned_kv(self, request: Any, index: int, block_hash: bytes) -> None:
        self._planned[KV][block_hash] = (request, index)

    def planned_state(self, request: Any, boundary_blocks: int, block_hash: bytes) -> None:
        self._planned[MAMBA][block_hash] = (request, boundary_blocks - 1)

    def loaded(self, request: Any, start: int, end: int) -> None:
        """A request loads blocks ``[start, end)`` and the state at ``end`` from the CPU tier."""
        kv, states = self._unannounced[KV], self._unannounced[MAMBA]
        if not (kv or states) or end <= start:
            return
        for i in range(start, end):
            h = self._hash(request, i)
            if h in kv:
                kv.discard(h)
                self._stored(KV, self._describe(request, i), MEDIUM_CPU)
        h = self._hash(request, end - 1)
        if h in states:
            states.discard(h)
            self._stored(MAMBA, self._describe(request, end - 1), MEDIUM_CPU)

    # -- the tree's observer -------------------------------------------------------------
    def host_kv(self, entered: bool, block_hash: bytes) -> None:
        self._host(KV, entered, block_hash)

    def host_state(self, entered: bool, block_hash: bytes) -> None:
        self._host(MAMBA, entered, block_hash)

    def _host(self, kind: int, entered: bool, h: bytes) -> None:
        if entered:
            planned = self._planned[kind].pop(h, None)
            if planned is None:  # fetched from storage: no request at hand yet
                self._unannounced[kind].add(h)
                return
            block = self._describe(*planned)
            self._stored(kind, block, MEDIUM_CPU)
            if self.write_through:  # the worker writes it through right after this copy
                self._expect_write(kind, block)
        else:
            unannounced = self._unannounced[kind]
            if h in unannounced:
                unannounced.discard(h)
            else:
                self._removed(kind, [h], MEDIUM_CPU)

    # -- storage outcomes from the workers ------------------------------------------------
    def absorb(self, outcomes: Sequence[StorageOutcome], epoch: str) -> None:
        """Workers' storage outcomes of one step (all ranks); ``epoch``: the current storage
        key epoch (outcomes of keys from before a reset are about unreachable objects)."""
        medium = self.storage_medium
        if medium is None:
            return
        removed: dict[int, list[bytes]] = {KV: [], MAMBA: []}
        seen: set[tuple[int, bytes]] = set()
        for o in outcomes:
            if o.epoch != epoch:
                continue
            key = (o.kind, o.block_hash)
            if o.op == StorageOp.WRITTEN:
                w = self._writes.get(key)
                if w is None:
                    w = self._writes[key] = _Write(None)
                    if len(self._writes) > self._max_writes:
                        self._writes.popitem(last=False)
                w.ranks.add(o.rank)
                if len(w.ranks) >= self.world_size:
                    del self._writes[key]
                    block = w.block or _Block(o.block_hash, None, [], None, None, None)
                    self._stored(o.kind, block, medium)
            else:
                self._writes.pop(key, None)
                if o.op == StorageOp.REMOVED and key not in seen:
                    seen.add(key)
                    removed[o.kind].append(o.block_hash)
        for kind, hashes in removed.items():
            if hashes:
                self._removed(kind, hashes, medium)

    def _expect_write(self, kind: int, block: _Block) -> None:
        key = (kind, block.block_hash)
        w = self._writes.get(key)
        if w is None:
            self._writes[key] = _Write(block)
            if len(self._writes) > self._max_writes:
                self._writes.popitem(last=False)
        else:
            w.block = block

    # -- out -----------------------------------------------------------------------------
    def take(self) -> list[KVCacheEvent]:
        """This step's events, consecutive blocks of a chain merged per group and medium."""
        for planned in self._planned.values():
            planned.clear()
        if not self._queue:
            return []
        events, self._queue = self._queue, []
        return merge_events(events)

    def pending(self) -> dict[str, int]:
        """What the tracker holds between steps (bounded by the host tier and in-flight writes)."""
        return {
            "events_unannounced_host_objects": sum(map(len, self._unannounced.values())),
            "events_pending_storage_writes": len(self._writes),
        }

    # -- payloads --------------------------------------------------------------------------
    def _hash(self, request: Any, index: int) -> bytes:
        return request.block_hashes[(index + 1) * self._per_block - 1]

    def _describe(self, request: Any, index: int) -> _Block:
        bs = self.block_size
        lora = getattr(request, "lora_request", None)
        return _Block(
            block_hash=self._hash(request, index),
            parent=self._hash(request, index - 1) if index > 0 else None,
            token_ids=list(request.all_token_ids[index * bs : (index + 1) * bs]),
            lora_id=None if lora is None else lora.adapter_id,
            lora_name=None if lora is None else lora.name,
            extra_keys=_extra_keys(request, index * bs, (index + 1) * bs),
        )

    def _stored(self, kind: int, block: _Block, medium: str) -> None:
        convert = maybe_convert_block_hash
        described = bool(block.token_ids)
        for gid, spec_kind in self._groups[kind]:
            self._queue.append(
                BlockStored(
                    block_hashes=[convert(block.block_hash)],
                    parent_block_hash=None if block.parent is None else convert(block.parent),
                    token_ids=list(block.token_ids),
                    block_size=self.block_size if described else 0,
                    lora_id=block.lora_id,
                    medium=medium,
                    lora_name=block.lora_name,
                    extra_keys=None if block.extra_keys is None else list(block.extra_keys),
                    group_idx=gid,
                    kv_cache_spec_kind=spec_kind,
                )
            )

    def _removed(self, kind: int, hashes: list[bytes], medium: str) -> None:
        convert = maybe_convert_block_hash
        for gid, _ in self._groups[kind]:
            self._queue.append(
                BlockRemoved(
                    block_hashes=[convert(h) for h in hashes], medium=medium, group_idx=gid
                )
            )


def merge_events(events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """Fold each event into the previous one of the same (type, medium, group) when it
    continues it: a store whose parent is the last hash stored, a removal after a removal.
    Only the latest event of each stream is extended, so order within a stream is kept."""
    out: list[KVCacheEvent] = []
    last: dict[tuple[Any, ...], int] = {}
    for ev in events:
        stream = (getattr(ev, "medium", None), getattr(ev, "group_idx", None))
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


def _extra_keys(request: Any, start: int, end: int) -> list[Any] | None:
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
