"""Everything that crosses the scheduler/worker process boundary, in one place.

vLLM pickles (or msgpacks) these between the engine core and every worker each step, so they
are small frozen records of ints, bytes and strings; nobody on the other side needs the tree,
a pool or a store to read them. Scheduler -> workers: one ``StepPlan`` per step (the
connector metadata). Workers -> scheduler: ``HiMambaWorkerMeta`` (fetch acknowledgements and
storage switches, merged across TP ranks by ``aggregate``) and ``HiMambaWorkerEvents`` (storage
outcomes for KV events, concatenated by vLLM).

Two rules make a plan safe to execute in order, and ``plan_conflicts`` checks the first:

* **One role per host slot per plan.** A slot is a store target, a fetch target, a storage
  write source or a load source, never a target together with anything else: the worker runs
  the parts of a plan at different hooks (writes and fetches at ``start_load_kv``, stores at
  ``wait_for_save``), so a slot with two roles would be read or written in an order nobody
  chose. Two reads of one slot (a load and a storage write of a popular block) are fine.
* **Generations.** Every fetch and write names the storage ``Generation`` it belongs to: the key
  epoch (changes at every reset, attached or not) and the planner that issued it (changes at
  every attach). Fetch ids are never reused across planners, so an acknowledgement can settle
  only the fetch it was sent for.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

try:  # vLLM's worker KV-events carrier (absent in builds without KV events)
    from vllm.distributed.kv_events import KVConnectorKVEvents
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorKVEvents = object  # type: ignore[assignment,misc]

from himamba.tiers.object_format import ObjectKind

__all__ = [
    "ControlAction",
    "ControlRequest",
    "FetchAck",
    "FetchItem",
    "FetchOrder",
    "Generation",
    "HiMambaWorkerEvents",
    "HiMambaWorkerMeta",
    "LoadJob",
    "ObjectKind",
    "PlanConflict",
    "SlotRole",
    "StepPlan",
    "StorageOp",
    "StorageOutcome",
    "StorageWrite",
    "StoreBatch",
    "StoreDone",
    "StoredBatch",
    "plan_conflicts",
]


# -- storage generations -----------------------------------------------------------------


@dataclass(frozen=True)
class Generation:
    """Which storage world a fetch or a write belongs to.

    ``epoch`` is part of every storage key: a reset moves to a new one, so nothing stored
    before it is found again. ``planner`` numbers the attached stores (0: none attached): an
    acknowledgement from another planner's fetch is stale by definition."""

    epoch: str = ""
    planner: int = 0


def key_salt(epoch: str, lora_tag: str = "") -> str:
    """The salt field of a storage key: the generation's epoch, and for a LoRA request the tag
    of its adapter's weights (vLLM's block hashes name the adapter, not its weights, so two
    instances sharing storage would otherwise read each other's KV across adapter versions)."""
    return f"{epoch}+{lora_tag}" if lora_tag else epoch


def salt_epoch(salt: str) -> str:
    """The epoch part of a key salt (see ``key_salt``)."""
    return salt.split("+", 1)[0]


# -- storage -> host fetches ---------------------------------------------------------------


@dataclass(frozen=True)
class FetchItem:
    """Read one stored object into a host slot the scheduler reserved for it."""

    kind: ObjectKind
    block_hash: bytes
    slot: int


@dataclass(frozen=True)
class FetchOrder:
    """Scheduler -> workers: one fetch, known by ``fetch_id`` for its whole life."""

    fetch_id: int
    items: tuple[FetchItem, ...]
    generation: Generation = Generation()
    lora_tag: str = ""  # the request's adapter weights (``key_salt``); "" without LoRA


@dataclass(frozen=True)
class FetchAck:
    """Worker -> scheduler: rank ``rank`` finished fetch ``fetch_id`` of planner ``planner``;
    ``ok[i]``: item i's bytes validated and now sit in its slot on that rank."""

    fetch_id: int
    planner: int
    rank: int
    ok: tuple[bool, ...]


# -- host <-> device copies ----------------------------------------------------------------


@dataclass(frozen=True)
class LoadJob:
    """Restore one request's prefix: KV blocks plus the Mamba state at its end."""

    req_id: str
    kv_slots: tuple[int, ...]
    # Per attention group (layout order): device block ids, parallel to kv_slots.
    kv_blocks: tuple[tuple[int, ...], ...]
    mamba_slot: int
    # Per Mamba group (layout order): the device block that must hold the state.
    mamba_blocks: tuple[int, ...]
    # Set when the scheduler already knows the load cannot be honoured; the worker then
    # reports it failed so vLLM recomputes instead of trusting it.
    doomed: str | None = None


@dataclass
class StoreBatch:
    """Device blocks to copy into host slots this step, after the forward (built by the
    scheduler, read-only once the plan is sent)."""

    slots: list[int] = field(default_factory=list)
    # Per group (layout order) one device block id per slot.
    blocks: list[list[int]] = field(default_factory=list)
    # The block hash naming each slot's content (its storage key), and its LoRA tag.
    hashes: list[bytes] = field(default_factory=list)
    lora_tags: list[str] = field(default_factory=list)

    def add(
        self, slot: int, group_blocks: list[int], block_hash: bytes, lora_tag: str = ""
    ) -> None:
        if not self.blocks:
            self.blocks = [[] for _ in group_blocks]
        self.slots.append(slot)
        self.hashes.append(block_hash)
        self.lora_tags.append(lora_tag)
        for column, block in zip(self.blocks, group_blocks, strict=True):
            column.append(block)

    def extend(
        self,
        slots: list[int],
        group_blocks: list[list[int]],
        block_hashes: list[bytes],
        lora_tag: str = "",
    ) -> None:
        """``add`` for a run of slots at once (``group_blocks``: per group, one block per slot)."""
        if not self.blocks:
            self.blocks = [[] for _ in group_blocks]
        self.slots.extend(slots)
        self.hashes.extend(block_hashes)
        self.lora_tags.extend([lora_tag] * len(slots))
        for column, blocks in zip(self.blocks, group_blocks, strict=True):
            column.extend(blocks)

    def __len__(self) -> int:
        return len(self.slots)

    def select(self, keep: Sequence[int]) -> StoreBatch:
        """The entries at positions ``keep``, in that order."""
        return StoreBatch(
            [self.slots[i] for i in keep],
            [[c[i] for i in keep] for c in self.blocks],
            [self.hashes[i] for i in keep],
            [self.lora_tags[i] for i in keep],
        )

    def split(self, n: int) -> tuple[StoreBatch, StoreBatch]:
        """The first ``n`` entries and the rest, as two batches."""
        if not n:
            return StoreBatch(), self
        head = StoreBatch(
            self.slots[:n], [c[:n] for c in self.blocks], self.hashes[:n], self.lora_tags[:n]
        )
        rest = StoreBatch(
            self.slots[n:], [c[n:] for c in self.blocks], self.hashes[n:], self.lora_tags[n:]
        )
        return head, rest


@dataclass(frozen=True)
class StorageWrite:
    """Copy a host object to storage before anything else touches its slot this step
    (selective write-through of a popular object, write-back of an evicted one)."""

    kind: ObjectKind
    slot: int
    block_hash: bytes
    lora_tag: str = ""


@dataclass
class StepPlan:
    """Everything the worker does for the connector in one engine step."""

    loads: list[LoadJob] = field(default_factory=list)
    kv_stores: StoreBatch = field(default_factory=StoreBatch)
    mamba_stores: StoreBatch = field(default_factory=StoreBatch)
    # Storage -> host fetches to start, and fetch ids to drop before anything else is done.
    fetches: list[FetchOrder] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)
    storage_writes: list[StorageWrite] = field(default_factory=list)
    # Host slots the scheduler freed since the last plan (only under write-back, where the
    # worker remembers which slots hold bytes storage lacks; a freed slot holds nothing).
    freed_kv: list[int] = field(default_factory=list)
    freed_mamba: list[int] = field(default_factory=list)
    # The first ``early_stores`` entries of ``kv_stores`` and of ``mamba_stores`` (one page
    # and one state per partial tail) read blocks vLLM freed when the last output came in:
    # workers copy them at the step's start (V1's first hook, or himamba's hook before Model
    # Runner V2's step), before vLLM can write those blocks, instead of after the forward.
    early_stores: int = 0
    # Early stores whose blocks this step hands out were dropped (the scheduler's side of V2
    # without the step-start hook): a worker in that mode refuses a plan without it.
    tails_screened: bool = False
    generation: Generation = Generation()
    # ``StorageConfig.identity()`` of the scheduler half's store ("": none): a rank that
    # switched stores knows the switch was followed when this names its own.
    storage_id: str = ""
    # vLLM scheduled no tokens: the step runs no forward, only the connector's own work.
    engine_idle: bool = False

    @property
    def epoch(self) -> str:
        return self.generation.epoch

    def moves_bytes(self) -> bool:
        """Whether the worker copies host-tier bytes this step."""
        return bool(self.loads or self.kv_stores or self.mamba_stores or self.storage_writes)

    def is_empty(self) -> bool:
        return not (self.moves_bytes() or self.fetches or self.cancels)


@dataclass(frozen=True)
class StoredBatch:
    """Host slots a completed store filled, and the block hash naming each one's content."""

    kind: ObjectKind
    slots: tuple[int, ...]
    hashes: tuple[bytes, ...]
    lora_tags: tuple[str, ...]


@dataclass(frozen=True)
class StoreDone:
    """A store the copy engine completed: what storage write-through may now read."""

    batches: tuple[StoredBatch, ...]
    epoch: str


# -- the plan validator --------------------------------------------------------------------


class SlotRole(enum.IntEnum):
    STORE_TARGET = 0
    FETCH_TARGET = 1
    WRITE_SOURCE = 2
    LOAD_SOURCE = 3


_TARGETS = (SlotRole.STORE_TARGET, SlotRole.FETCH_TARGET)


class PlanConflict(AssertionError):
    """A step plan gives one host slot two roles (see the module docstring)."""


def _slot_roles(plan: StepPlan) -> Iterator[tuple[ObjectKind, int, SlotRole]]:
    for slot in plan.kv_stores.slots:
        yield ObjectKind.KV, slot, SlotRole.STORE_TARGET
    for slot in plan.mamba_stores.slots:
        yield ObjectKind.MAMBA, slot, SlotRole.STORE_TARGET
    for order in plan.fetches:
        for item in order.items:
            yield item.kind, item.slot, SlotRole.FETCH_TARGET
    for w in plan.storage_writes:
        yield w.kind, w.slot, SlotRole.WRITE_SOURCE
    for job in plan.loads:
        if job.doomed:
            continue  # the worker copies nothing for it
        for slot in job.kv_slots:
            yield ObjectKind.KV, slot, SlotRole.LOAD_SOURCE
        yield ObjectKind.MAMBA, job.mamba_slot, SlotRole.LOAD_SOURCE


def plan_conflicts(plan: StepPlan) -> list[tuple[ObjectKind, int, tuple[SlotRole, ...]]]:
    """Every host slot the plan writes into that has another role in the same plan (or the
    same target role twice): ``(kind, slot, roles)``. Empty for a safe plan."""
    roles: dict[tuple[ObjectKind, int], list[SlotRole]] = {}
    for kind, slot, role in _slot_roles(plan):
        roles.setdefault((kind, slot), []).append(role)
    return [
        (kind, slot, tuple(rs))
        for (kind, slot), rs in roles.items()
        if len(rs) > 1 and any(r in _TARGETS for r in rs)
    ]


def check_plan(plan: StepPlan) -> None:
    """Raise ``PlanConflict`` naming the slots of an unsafe plan."""
    conflicts = plan_conflicts(plan)
    if conflicts:
        shown = ", ".join(
            f"{kind.name} slot {slot}: {'+'.join(r.name for r in roles)}"
            for kind, slot, roles in conflicts[:8]
        )
        raise PlanConflict(f"himamba: step plan gives host slots two roles: {shown}")


# -- run-time control ----------------------------------------------------------------------


class ControlAction(str, enum.Enum):
    ATTACH = "attach_storage"
    DETACH = "detach_storage"
    STATUS = "status"


@dataclass(frozen=True)
class ControlRequest:
    """Worker -> scheduler: a storage switch the workers made (``storage_json``: the section
    attached, "" for the configured one)."""

    action: ControlAction
    storage_json: str = ""

    def storage(self) -> dict[str, Any] | None:
        return json.loads(self.storage_json) if self.storage_json else None


# -- worker -> scheduler ---------------------------------------------------------------------


@dataclass
class HiMambaWorkerMeta(KVConnectorWorkerMetadata):
    """What workers tell the scheduler half each step. vLLM merges the workers' metadata per
    step only; the scheduler's fetch ledger accumulates acknowledgements across steps."""

    fetch_acks: list[FetchAck] = field(default_factory=list)
    # Run-time storage switches (every rank reports its own; idempotent).
    control: list[ControlRequest] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> HiMambaWorkerMeta:
        assert isinstance(other, HiMambaWorkerMeta)
        control = [*self.control, *(c for c in other.control if c not in self.control)]
        return HiMambaWorkerMeta([*self.fetch_acks, *other.fetch_acks], control)


class StorageOp(enum.IntEnum):
    WRITTEN = 0  # this rank's shard of the object is in storage
    WRITE_FAILED = 1  # this rank's write failed or was skipped: the object is incomplete
    REMOVED = 2  # this rank's shard is gone (capacity eviction) or unusable (missing, invalid)


class StorageOutcome(NamedTuple):
    """One storage fact a worker saw."""

    op: StorageOp
    rank: int
    kind: int  # ObjectKind value
    block_hash: bytes
    epoch: str


class HiMambaWorkerEvents(KVConnectorKVEvents):  # type: ignore[misc,valid-type]
    """Worker storage outcomes of one step, on vLLM's worker-events channel.

    vLLM's ``KVOutputAggregator`` only concatenates them across TP workers; the scheduler
    connector turns them into vLLM events (``KVEventTracker.absorb``): they are never
    published as they are."""

    def __init__(self, outcomes: list[StorageOutcome] | None = None) -> None:
        self.outcomes: list[StorageOutcome] = list(outcomes or ())
        self.workers = 1

    # vLLM only concatenates these across workers; they never leave as ``KVCacheEvent``s.
    def add_events(self, events: list[StorageOutcome]) -> None:  # type: ignore[override]
        self.outcomes.extend(events)

    def aggregate(self) -> HiMambaWorkerEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def reset_workers(self) -> None:
        self.workers = 1

    def get_all_events(self) -> list[StorageOutcome]:  # type: ignore[override]
        return list(self.outcomes)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.outcomes = []
