"""KV-cache events for routers: what enters and leaves the CPU tier and storage.

vLLM publishes what its GPU cache holds as ``BlockStored`` / ``BlockRemoved`` events (medium
``"GPU"``); KV-aware routers (llm-d, Dynamo, the production stack) route by them. These are the
same events for our tiers, published by vLLM's own publisher (``--kv-events-config``) through the
scheduler connector's ``take_events``, under vLLM's own medium names:

* ``"CPU"`` (``MEDIUM_CPU``): the host tier. Stored when a block's or state's bytes are
  committed to a host slot, removed when the slot is freed (LRU eviction, the prefix cascade, a
  replaced decode state, reset). Exact: driven by the tree itself
  (``HybridRadixTree.set_observer``), not by our guess of it.
* ``"STORAGE"`` (``MEDIUM_STORAGE``): the attached store, while one is attached; see
  ``storage_events`` for when, with which payload, and what a detach or a reset retracts.

Payloads follow vLLM's GPU events for the same groups (``event_payloads``): one event per KV
cache group (``group_idx``, ``kv_cache_spec_kind``); consecutive blocks of a chain are merged
into one event per group and medium. A Mamba state at boundary ``n`` is announced as the Mamba
group's block ``n - 1`` (what vLLM's GPU cache announces for the same state in align mode): a
router that wants hybrid hits needs both halves.

Where the request is not at hand, token ids are not invented: a block fetched from storage into
the CPU tier is announced when a request loads it (the request then is at hand); one never
loaded is never announced, and its removal is silent. vLLM's own ``AllBlocksCleared``
accompanies every prefix-cache reset; it comes from its GPU pool, and after a GPU-only reset our
tiers still hold their blocks.

Cost: nothing exists unless events are enabled with a real publisher (``events_enabled``); the
tree's observer slot is then None and the halves skip every call with one attribute test.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from himamba.connector.observability.event_payloads import (
    BlockPayload,
    describe_block,
    merge_events,
)
from himamba.connector.observability.storage_events import StorageEvents
from himamba.connector.protocol import StorageOutcome
from himamba.tiers.object_format import KV_OBJECT as KV
from himamba.tiers.object_format import MAMBA_OBJECT as MAMBA

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from himamba.connector.layout import HybridLayout
    from himamba.tiers.storage_config import StorageConfig

__all__ = ["KVEventTracker", "events_enabled", "group_kinds", "merge_events"]


def events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM will publish connector events (enabled, with a publisher that sends)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(
        cfg is not None
        and getattr(cfg, "enable_kv_cache_events", False)
        and getattr(cfg, "publisher", "null") not in (None, "null")
    )


def group_kinds(layout: HybridLayout, kv_cache_config: KVCacheConfig | None) -> dict[int, str]:
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


class KVEventTracker:
    """Scheduler-side source of our KV events (see the module doc for what and when).

    It is the tree's observer (``host_kv`` / ``host_state``); the scheduler half tells it what
    it plans to store (``planned_kv`` / ``planned_state``, with the request) and what a request
    loads (``loaded``); the connector tells it which store is attached (``storage_attached`` /
    ``storage_detached`` / ``storage_reset``), feeds it the workers' storage outcomes
    (``absorb``) and drains it once per step (``take``)."""

    def __init__(
        self,
        layout: HybridLayout,
        kinds: dict[int, str],
        workers: int = 1,
        max_pending_writes: int = 65536,
    ) -> None:
        self.block_size = layout.block_size
        self._per_block = layout.hashes_per_block
        self._groups = {
            KV: [(g.group_id, kinds[g.group_id]) for g in layout.attention],
            MAMBA: [(g.group_id, kinds[g.group_id]) for g in layout.mamba],
        }
        self.storage = StorageEvents(self, workers, max_pending_writes)
        # Stores planned this step: hash -> (request, block index); committed (or not) by the
        # tree within the same step, so whatever is left at ``take`` is dropped.
        self._planned: dict[int, dict[bytes, tuple[Request, int]]] = {KV: {}, MAMBA: {}}
        # Host objects that came from storage and that no request has loaded yet: announced
        # when one does (the request gives the tokens); removed silently if none ever does.
        self._unannounced: dict[int, set[bytes]] = {KV: set(), MAMBA: set()}
        self._queue: list[KVCacheEvent] = []

    # -- which store is attached -----------------------------------------------------------
    def storage_attached(self, cfg: StorageConfig) -> None:
        """``cfg`` (a ``StorageConfig``) is the store from now on (any previous one is gone)."""
        self.storage.attach(cfg.adapter, cfg.write_policy)

    def storage_detached(self) -> None:
        self.storage.detach()

    def storage_reset(self) -> None:
        """A new key epoch: nothing stored before it can be read again."""
        self.storage.retract()

    # -- what the scheduler half tells us ------------------------------------------------
    def planned_kv(self, request: Request, index: int, block_hash: bytes) -> None:
        self._planned[KV][block_hash] = (request, index)

    def planned_state(self, request: Request, boundary_blocks: int, block_hash: bytes) -> None:
        self._planned[MAMBA][block_hash] = (request, boundary_blocks - 1)

    def loaded(self, request: Request, start: int, end: int) -> None:
        """A request loads blocks ``[start, end)`` and the state at ``end`` from the CPU tier."""
        kv, states = self._unannounced[KV], self._unannounced[MAMBA]
        if not (kv or states) or end <= start:
            return
        for i in range(start, end):
            h = self._hash(request, i)
            if h in kv:
                kv.discard(h)
                self.stored(KV, self._describe(request, i), MEDIUM_CPU)
        h = self._hash(request, end - 1)
        if h in states:
            states.discard(h)
            self.stored(MAMBA, self._describe(request, end - 1), MEDIUM_CPU)

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
            self.stored(kind, block, MEDIUM_CPU)
            self.storage.expect_write(kind, block)
        else:
            unannounced = self._unannounced[kind]
            if h in unannounced:
                unannounced.discard(h)
            else:
                self.removed(kind, [h], MEDIUM_CPU)

    # -- storage outcomes from the workers ------------------------------------------------
    def absorb(self, outcomes: Sequence[StorageOutcome], epoch: str) -> None:
        """Workers' storage outcomes of one step (all ranks) under key epoch ``epoch``."""
        self.storage.absorb(outcomes, epoch)

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
        """What the tracker holds between steps (bounded by the host tier, in-flight writes and
        the announced storage objects)."""
        return {
            "events_unannounced_host_objects": sum(map(len, self._unannounced.values())),
            **self.storage.pending(),
        }

    # -- payloads --------------------------------------------------------------------------
    def _hash(self, request: Request, index: int) -> bytes:
        return request.block_hashes[(index + 1) * self._per_block - 1]

    def _describe(self, request: Request, index: int) -> BlockPayload:
        return describe_block(request, index, self.block_size, self._per_block)

    def stored(
        self, kind: int, block: BlockPayload, medium: str, ownership: str | None = None
    ) -> None:
        convert = maybe_convert_block_hash
        described = block.described
        for gid, spec_kind in self._groups[kind]:
            self._queue.append(
                BlockStored(
                    block_hashes=[convert(block.block_hash)],
                    parent_block_hash=None if block.parent is None else convert(block.parent),
                    token_ids=list(block.token_ids or ()),
                    block_size=self.block_size if described else 0,
                    lora_id=block.lora_id,
                    medium=medium,
                    lora_name=block.lora_name,
                    extra_keys=None if block.extra_keys is None else list(block.extra_keys),
                    group_idx=gid,
                    kv_cache_spec_kind=spec_kind,
                    ownership=ownership,
                )
            )

    def removed(
        self, kind: int, hashes: list[bytes], medium: str, ownership: str | None = None
    ) -> None:
        convert = maybe_convert_block_hash
        for gid, _ in self._groups[kind]:
            self._queue.append(
                BlockRemoved(
                    block_hashes=[convert(h) for h in hashes],
                    medium=medium,
                    group_idx=gid,
                    ownership=ownership,
                )
            )
