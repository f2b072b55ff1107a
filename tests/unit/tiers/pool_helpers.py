"""Whole-slot reads and writes of a `HostSlotPool`, for tests that seed or check slot bytes.

Production code moves slots through copy plans and storage views, never whole slots through
Python, so these live here. Import as ``unit.tiers.pool_helpers`` (the ``tests`` folder is on
``sys.path``; this folder has no ``__init__.py``).
"""

from __future__ import annotations

import torch

from himamba.tiers.cpu_pool import HostSlotPool


def read_slot(pool: HostSlotPool, slot: int) -> torch.Tensor:
    """All layers of one slot, back to back, as a fresh contiguous byte tensor."""
    out = torch.empty(pool.slot_bytes, dtype=torch.uint8)
    out.numpy()[:] = pool.slot_payload(slot)
    return out


def write_slot(pool: HostSlotPool, slot: int, data: torch.Tensor) -> None:
    """Inverse of `read_slot`; `data` must be exactly `slot_bytes` long."""
    if data.numel() != pool.slot_bytes:
        raise ValueError(f"slot payload is {data.numel()} bytes, expected {pool.slot_bytes}")
    pool.slot_payload(slot)[:] = data.numpy()
