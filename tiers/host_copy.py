"""The CPU tier's hot loop: a copy plan's rows moved by numpy on the copy thread.

A random batch moves one row per block, segment and layer (64 blocks x 32 layers = 2,048
rows of 36-64 KiB). Each row is a memcpy at memory speed, so what separates a batch from one
plain memcpy of the same bytes is the Python work around the rows. Hence:

- ``Runs`` cuts an id list into runs once per distinct list; every layer that shares it
  (all of a KV group's layers do) reuses them, and no per-row object is built to plan.
- ``copy_rows`` walks those shared runs per segment with integer-indexed numpy rows (~0.2 us
  of overhead a row, the cheapest view numpy has), in plan order, on the calling thread
  alone: numpy copies take no intra-op threads, so the engine keeps its cores (torch's
  ``_foreach_copy_`` was tried: slower, and it ran on two cores).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class Runs(NamedTuple):
    """``(first block, first slot, count)`` runs of one id list, and whether all are single
    rows (a random batch: the loop then skips the run-length branch)."""

    runs: list[tuple[int, int, int]]
    singles: bool


def find_runs(block_ids: Sequence[int], slots: Sequence[int]) -> Runs:
    """Stretches where both ids go up by one: vLLM hands out blocks from a free queue and the
    host pool hands out slots in order, so a request's blocks and slots are often consecutive
    and one copy of ``count`` rows moves them."""
    if len(block_ids) != len(slots):
        raise ValueError(f"{len(block_ids)} blocks for {len(slots)} slots")
    runs: list[tuple[int, int, int]] = []
    for b, s in zip(block_ids, slots, strict=True):
        if runs:
            b0, s0, n = runs[-1]
            if b == b0 + n and s == s0 + n:
                runs[-1] = (b0, s0, n + 1)
                continue
        runs.append((b, s, 1))
    return Runs(runs, all(n == 1 for _, _, n in runs))


def copy_rows(np_seg: np.ndarray, np_host: np.ndarray, runs: Runs, to_host: bool) -> None:
    """Move one segment's runs between the cache rows and the pool's columns, in order."""
    if runs.singles:  # one row a block: integer indexing, no slice objects
        if to_host:
            for b, s, _ in runs.runs:
                np_host[s] = np_seg[b]
        else:
            for b, s, _ in runs.runs:
                np_seg[b] = np_host[s]
        return
    for b, s, n in runs.runs:
        if n == 1:
            cache_rows, pool_rows = np_seg[b], np_host[s]
        else:
            cache_rows, pool_rows = np_seg[b : b + n], np_host[s : s + n]
        if to_host:
            pool_rows[...] = cache_rows
        else:
            cache_rows[...] = pool_rows
