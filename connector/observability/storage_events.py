"""KV events of the storage tier: what a router may route to while a store is attached.

Medium ``"STORAGE"`` (vLLM's ``MEDIUM_STORAGE``, the medium its own secondary tiers announce),
with the LMCache adapter type as ``ownership`` (vLLM's "secondary offloading tier identifier":
``fs_native``, ``resp``, ``s3``, ...), so a router can tell stores apart without a medium
vLLM does not define.

* An object is announced stored once *every* worker reporting to this scheduler wrote its
  shard (each TP rank holds one; a block is loadable only if all are there), and removed when
  any rank evicted it (``capacity_gb``) or found it missing or invalid. The workers see these
  outcomes; they reach the scheduler as ``HiMambaWorkerEvents`` (vLLM's worker-events
  channel).
* Payload: under ``write_through`` the block's tokens and parent, captured when it entered the
  CPU tier (the write follows that copy). ``write_through_selective`` and ``write_back`` write
  long after, when no request describes the block any more: ``token_ids=[]``,
  ``block_size=0``, no parent, as vLLM's offloading connector announces payloads it cannot
  describe. Removals need only hashes.
* The announcements follow the attached store: an attach (at start-up or at run time) starts
  them under that store's write policy; a detach removes everything announced for the store it
  retires (a router must not route to a tier that is gone), and so does a reset, whose new key
  epoch makes every stored object unreachable. For that every announced object is remembered,
  up to ``max_announced`` per kind (past it the oldest are forgotten, and a detach cannot
  retract those).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm.distributed.kv_events import MEDIUM_STORAGE

from himamba.connector.observability.event_payloads import BlockPayload
from himamba.connector.protocol import StorageOp, StorageOutcome
from himamba.tiers.object_format import KV_OBJECT as KV
from himamba.tiers.object_format import MAMBA_OBJECT as MAMBA

STORAGE_MEDIUM = MEDIUM_STORAGE


def storage_ownership(adapter: dict[str, Any] | None) -> str:
    """The ``ownership`` of a store's events: its LMCache adapter type."""
    return str((adapter or {}).get("type", "storage"))


class Emitter(Protocol):
    def stored(
        self, kind: int, block: BlockPayload, medium: str, ownership: str | None
    ) -> None: ...

    def removed(
        self, kind: int, hashes: list[bytes], medium: str, ownership: str | None
    ) -> None: ...


@dataclass(slots=True)
class _Write:
    """A storage write some ranks acknowledged; announced when all did."""

    block: BlockPayload | None
    ranks: set[int] = field(default_factory=set)


class StorageEvents:
    """The storage half of ``KVEventTracker`` (see the module doc)."""

    def __init__(
        self,
        emit: Emitter,
        workers: int = 1,
        max_pending_writes: int = 65536,
        max_announced: int = 1 << 20,
    ) -> None:
        self._emit = emit
        self.workers = workers
        self.ownership: str | None = None  # None: no store attached
        self.write_through = False
        self._max_writes = max_pending_writes
        self._max_announced = max_announced
        self._writes: OrderedDict[tuple[int, bytes], _Write] = OrderedDict()
        self._announced: dict[int, OrderedDict[bytes, None]] = {
            KV: OrderedDict(),
            MAMBA: OrderedDict(),
        }

    @property
    def attached(self) -> bool:
        return self.ownership is not None

    def attach(self, adapter: dict[str, Any], write_policy: str) -> None:
        if self.attached:
            self.detach()
        self.ownership = storage_ownership(adapter)
        self.write_through = write_policy == "write_through"

    def detach(self) -> None:
        self.retract()
        self.ownership = None
        self.write_through = False

    def retract(self) -> None:
        """Everything announced as stored is gone (detached, or unreachable after a reset)."""
        self._writes.clear()
        for kind, announced in self._announced.items():
            if announced:
                self._emit.removed(kind, list(announced), STORAGE_MEDIUM, self.ownership)
                announced.clear()

    def expect_write(self, kind: int, block: BlockPayload) -> None:
        """A block entered the CPU tier; under write_through its write follows: keep its
        payload for the announcement."""
        if not self.write_through:
            return
        key = (kind, block.block_hash)
        w = self._writes.get(key)
        if w is None:
            self._writes[key] = _Write(block)
            if len(self._writes) > self._max_writes:
                self._writes.popitem(last=False)
        else:
            w.block = block

    def absorb(self, outcomes: Sequence[StorageOutcome], epoch: str) -> None:
        """Workers' storage outcomes of one step (all ranks); ``epoch``: the current storage
        key epoch (outcomes of keys from before a reset are about unreachable objects)."""
        if not self.attached:
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
                if len(w.ranks) >= self.workers:
                    del self._writes[key]
                    self._stored(o.kind, w.block or BlockPayload(o.block_hash))
            else:
                self._writes.pop(key, None)
                # Removed even if not remembered (forgotten past max_announced, or announced
                # by another rank's outcome this step): consumers treat removals idempotently.
                if o.op == StorageOp.REMOVED and key not in seen:
                    seen.add(key)
                    self._announced[o.kind].pop(o.block_hash, None)
                    removed[o.kind].append(o.block_hash)
        for kind, hashes in removed.items():
            if hashes:
                self._emit.removed(kind, hashes, STORAGE_MEDIUM, self.ownership)

    def _stored(self, kind: int, block: BlockPayload) -> None:
        announced = self._announced[kind]
        announced[block.block_hash] = None
        announced.move_to_end(block.block_hash)
        if len(announced) > self._max_announced:
            announced.popitem(last=False)
        self._emit.stored(kind, block, STORAGE_MEDIUM, self.ownership)

    def pending(self) -> dict[str, int]:
        return {
            "events_pending_storage_writes": len(self._writes),
            "events_storage_objects_announced": sum(map(len, self._announced.values())),
        }
