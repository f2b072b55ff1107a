"""The pinned-CPU tier's memory: one row of bytes per (layer, slot).

Layer-major rows let a batch of slots for one layer be copied with a single
index op, the granularity at which vLLM's caches are laid out too. Memory is
pinned when a CUDA device is present so device<->host copies can be async.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class HostSlotPool:
    """Fixed-size slots; slot s of layer l is ``rows[l][s]`` (uint8, ``layer_bytes[l]`` long)."""

    def __init__(self, layer_bytes: Sequence[int], num_slots: int, pin: bool = False) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.layer_bytes = list(layer_bytes)
        self.num_slots = num_slots
        total = sum(self.layer_bytes)
        # One allocation so pinning (and page faults) happen once, up front.
        self._buffer = torch.empty((num_slots * total,), dtype=torch.uint8, pin_memory=pin)
        if not pin:
            # Fault every page in now: first-touch page faults would otherwise land on
            # the first stores, inside an engine step (pinning already faults them in).
            self._buffer.zero_()
        self.rows: list[torch.Tensor] = []
        offset = 0
        for nbytes in self.layer_bytes:
            self.rows.append(
                self._buffer[offset : offset + num_slots * nbytes].view(num_slots, nbytes)
            )
            offset += num_slots * nbytes
        # numpy views of the same rows: numpy row copies are memcpys, torch's CPU
        # copy_ of uint8 rows is an order of magnitude slower on these builds.
        self.np_rows = [row.numpy() for row in self.rows]

    @property
    def slot_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def nbytes(self) -> int:
        return self._buffer.numel()

    def slot_segments(self, slot: int) -> list[np.ndarray]:
        """One slot as views of its per-layer rows, in order (no copy): a storage put copies
        them straight into its staging buffer."""
        return [row[slot] for row in self.np_rows]

    def read_slot(self, slot: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """All layers of one slot as one contiguous byte tensor (for storage tiers)."""
        out = torch.empty(self.slot_bytes, dtype=torch.uint8) if out is None else out
        dst = out.numpy()
        offset = 0
        for row, nbytes in zip(self.np_rows, self.layer_bytes, strict=True):
            dst[offset : offset + nbytes] = row[slot]
            offset += nbytes
        return out

    def write_slot(self, slot: int, data: torch.Tensor) -> None:
        """Inverse of read_slot; ``data`` must be exactly slot_bytes long."""
        if data.numel() != self.slot_bytes:
            raise ValueError(f"slot payload is {data.numel()} bytes, expected {self.slot_bytes}")
        src = data.numpy()
        offset = 0
        for row, nbytes in zip(self.np_rows, self.layer_bytes, strict=True):
            row[slot] = src[offset : offset + nbytes]
            offset += nbytes
