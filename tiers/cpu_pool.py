"""The pinned-CPU tier's memory: fixed-size slots, each one contiguous run of bytes.

A slot is ``head_bytes`` of room for a storage object's header, then its per-layer rows back
to back: a storage read lands a whole object (header + payload) straight in the slot, with no
staging copy (a staging copy holds reads to a third of plain file reads). Layer l of every
slot is still a ``[num_slots, layer_bytes]`` view (strided), so device copies plan per layer.

Slot ids are logical. Each maps to a physical slot, and a few spare physical slots stand by:
when a storage adapter may still write into a slot its reader gave up (a deadline, a cancel),
the logical slot moves onto a spare, and the old memory comes back only once the adapter let
go of it. The scheduler never learns of it and may reuse the slot id at once.
Memory is pinned when a CUDA device is present so device<->host copies can be async.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 64  # slot starts (and so object headers) on cache-line boundaries


def spare_slots(num_slots: int) -> int:
    """Spare physical slots for a pool of `num_slots` (1/16, at least 1, at most 256): they
    bound how many slots can be lent to storage reads at once, not the pool's capacity."""
    return 0 if num_slots < 2 else min(256, max(1, num_slots // 16))


def split_slots(total: int) -> int:
    """The most slots whose pool, spares included, fits `total` slots of memory (at least 1)."""
    n = max(1, total - spare_slots(total))
    while n < total and n + 1 + spare_slots(n + 1) <= total:
        n += 1
    return n


class HostSlotPool:
    """``num_slots`` logical slots; layer l of slot s is ``rows[l][physical(s)]`` (uint8)."""

    def __init__(
        self,
        layer_bytes: Sequence[int],
        num_slots: int,
        pin: bool = False,
        head_bytes: int = 0,
        spares: int = 0,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.layer_bytes = list(layer_bytes)
        self.num_slots = num_slots
        self.head_bytes = head_bytes
        payload = sum(self.layer_bytes)
        self.stride = -(-(head_bytes + payload) // _ALIGN) * _ALIGN
        physical = num_slots + spares
        # One allocation so pinning (and page faults) happen once, up front.
        self._buffer = torch.empty((physical * self.stride,), dtype=torch.uint8, pin_memory=pin)
        if not pin:
            # Fault every page in now: first-touch page faults would otherwise land on
            # the first stores, inside an engine step (pinning already faults them in).
            self._buffer.zero_()
        grid = self._buffer.view(physical, self.stride)
        self._flat = self._buffer.numpy()
        self.rows: list[torch.Tensor] = []
        offset = head_bytes
        for nbytes in self.layer_bytes:
            self.rows.append(grid[:, offset : offset + nbytes])
            offset += nbytes
        # numpy views of the same rows: numpy row copies are memcpys, torch's CPU
        # copy_ of uint8 rows is an order of magnitude slower on these builds.
        self.np_rows = [row.numpy() for row in self.rows]
        self._phys = list(range(num_slots))
        self._spares = list(range(num_slots, physical))
        self._columns: dict[tuple[int, int, int], tuple[torch.Tensor, np.ndarray]] = {}

    @property
    def slot_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def nbytes(self) -> int:
        return self._buffer.numel()

    @property
    def spares_free(self) -> int:
        return len(self._spares)

    def columns(self, layer: int, start: int, stop: int) -> tuple[torch.Tensor, np.ndarray]:
        """Columns ``start:stop`` of layer ``layer``'s rows (torch and numpy views), made once:
        every copy plan asks for the same few, and the GPU copy path keys what it works out
        about a plan's layout on these objects."""
        key = (layer, start, stop)
        views = self._columns.get(key)
        if views is None:
            views = self._columns[key] = (
                self.rows[layer][:, start:stop],
                self.np_rows[layer][:, start:stop],
            )
        return views

    def physical(self, slots: Sequence[int]) -> list[int]:
        """Where the logical `slots` live now (copy plans index the rows with these)."""
        phys = self._phys
        return [phys[s] for s in slots]

    def slot_payload(self, slot: int) -> np.ndarray:
        """One slot's layer rows, back to back, as one view (no copy): a storage put copies it
        into its staging buffer in one memcpy."""
        start = self._phys[slot] * self.stride + self.head_bytes
        return self._flat[start : start + self.slot_bytes]

    def slot_object(self, slot: int) -> np.ndarray:
        """Header room + payload of one slot, contiguous: a storage object read in place."""
        start = self._phys[slot] * self.stride
        return self._flat[start : start + self.head_bytes + self.slot_bytes]

    def swap_out(self, slot: int) -> int:
        """Move logical `slot` onto a spare and return its old physical slot, which nobody
        uses until `take_back` (someone else may still be writing into it)."""
        if not self._spares:
            raise RuntimeError("no spare host slot left")
        old, self._phys[slot] = self._phys[slot], self._spares.pop()
        return old

    def take_back(self, physical: int) -> None:
        """A physical slot given up by `swap_out` is free again (a spare)."""
        self._spares.append(physical)
