"""Storage objects some rank could not read, remembered per storage epoch.

A probe asks one store (the scheduler's); a fetch reads on every rank. When a rank's shard of
an object is missing (a skipped or evicted write), the probe keeps saying yes, so without this
memory every request with that prefix would go into the same failing fetch. An object is
masked out of probe answers until it is written again (on every rank) or the epoch moves.
"""

from __future__ import annotations

from collections import OrderedDict

from himamba.connector.protocol import ObjectKind

# How many objects are remembered (oldest forgotten first).
MISSING_MEMORY = 65536


class MissingObjects:
    def __init__(self, limit: int = MISSING_MEMORY) -> None:
        self._limit = limit
        self._epochs: OrderedDict[tuple[ObjectKind, bytes], str] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._epochs)

    def clear(self) -> None:
        self._epochs.clear()

    def remember(self, kind: ObjectKind, block_hash: bytes, epoch: str) -> None:
        self._epochs[(kind, block_hash)] = epoch
        self._epochs.move_to_end((kind, block_hash))
        while len(self._epochs) > self._limit:
            self._epochs.popitem(last=False)

    def forget(self, kind: ObjectKind, block_hash: bytes) -> None:
        """The object is being written again (every rank): it may be whole now."""
        self._epochs.pop((kind, block_hash), None)

    def has(self, kind: ObjectKind, block_hash: bytes, epoch: str) -> bool:
        return self._epochs.get((kind, block_hash)) == epoch

    def mask(self, hashes: list[bytes], kv_ok: list[bool], mamba_ok: list[bool], epoch: str) -> int:
        """Turn the known-missing objects of a probe answer into misses; returns how many."""
        masked = 0
        for i, h in enumerate(hashes):
            if kv_ok[i] and self.has(ObjectKind.KV, h, epoch):
                kv_ok[i] = False
                masked += 1
            if mamba_ok[i] and self.has(ObjectKind.MAMBA, h, epoch):
                mamba_ok[i] = False
                masked += 1
        return masked
