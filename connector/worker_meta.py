"""What workers tell the scheduler half each step, merged across TP workers by vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from himamba.connector.control import ControlRequest
from himamba.connector.fetch_protocol import FetchAck


@dataclass
class HiMambaWorkerMeta(KVConnectorWorkerMetadata):
    # One entry per (fetch, rank) that finished on a worker this step. vLLM merges workers' metadata
    # per step only; the scheduler's FetchLedger accumulates them across steps.
    fetch_acks: list[FetchAck] = field(default_factory=list)
    # Run-time storage switches the workers made (every rank reports its own; idempotent).
    control: list[ControlRequest] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> HiMambaWorkerMeta:
        assert isinstance(other, HiMambaWorkerMeta)
        control = [*self.control, *(c for c in other.control if c not in self.control)]
        return HiMambaWorkerMeta([*self.fetch_acks, *other.fetch_acks], control)
