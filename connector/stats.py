"""Worker transfer counters in the shape vLLM's stats logger aggregates across workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class HiMambaStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_counters(cls, counters: dict[str, float]) -> HiMambaStats | None:
        return cls(data=dict(counters)) if any(counters.values()) else None

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> HiMambaStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float))}

    def is_empty(self) -> bool:
        return not any(self.data.values())
