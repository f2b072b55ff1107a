"""How vLLM packs one Mamba layer's state into a cache page, and how to read it back.

vLLM gives each Mamba layer a raw int8 page view ``[num_blocks, 1, 1, C]``; the
C bytes are the layer's states (e.g. conv then SSM) back to back in spec order.
We copy pages as opaque bytes, but tests and debugging need the typed views to
compare a restored state with a recomputed one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StatePart:
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class MambaStateLayout:
    parts: tuple[StatePart, ...]

    @classmethod
    def from_spec(
        cls, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]
    ) -> MambaStateLayout:
        parts, offset = [], 0
        for shape, dtype in zip(shapes, dtypes, strict=True):
            part = StatePart(tuple(int(s) for s in shape), dtype, offset)
            parts.append(part)
            offset += part.nbytes
        return cls(tuple(parts))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def unpack(self, page: torch.Tensor) -> list[torch.Tensor]:
        """Typed views (e.g. [conv, ssm]) of one page's bytes (a 1-D uint8/int8 tensor)."""
        flat = page.reshape(-1)
        if flat.numel() < self.nbytes:
            raise ValueError(f"page has {flat.numel()} bytes, state needs {self.nbytes}")
        return [
            flat[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in self.parts
        ]
