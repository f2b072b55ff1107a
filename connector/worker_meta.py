"""What workers tell the scheduler half each step, merged across TP/PP workers by vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata


@dataclass
class HiMambaWorkerMeta(KVConnectorWorkerMetadata):
    # (kind, host slot) -> [workers whose fetch succeeded, workers whose fetch failed]
    fetch_acks: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> HiMambaWorkerMeta:
        assert isinstance(other, HiMambaWorkerMeta)
        merged = {k: list(v) for k, v in self.fetch_acks.items()}
        for key, (ok, bad) in other.fetch_acks.items():
            counts = merged.setdefault(key, [0, 0])
            counts[0] += ok
            counts[1] += bad
        return HiMambaWorkerMeta(merged)
