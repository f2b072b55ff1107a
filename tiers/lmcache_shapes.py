"""How our keys and buffers look to LMCache: `ObjectKey`s and zero-copy `TensorMemoryObj`s.

LMCache is imported when this is constructed, not at module import: the scheduler and the
config parser must load without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .object_format import Namespace, StorageKey, salt_tag


class LMCacheShapes:
    """One namespace's mapping of `StorageKey` -> LMCache key, and staging buffer -> memory obj."""

    def __init__(self, namespace: Namespace) -> None:
        from lmcache.v1.distributed.api import ObjectKey
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

        self._ObjectKey, self._Meta, self._TMO = ObjectKey, MemoryObjMetadata, TensorMemoryObj
        self._fmt = MemoryFormat.BINARY
        self._tag, self._rank = namespace.model_tag(), namespace.kv_rank()

    def object_key(self, k: StorageKey) -> Any:
        return self._ObjectKey(
            chunk_hash=k.block_hash,
            model_name=self._tag,
            kv_rank=self._rank,
            object_group_id=int(k.kind),
            cache_salt=salt_tag(k.cache_salt),
        )

    def key_string(self, k: StorageKey) -> str:
        """The adapter's key for `k` (fs: file name without '.data'; resp: the Redis key)."""
        st = salt_tag(k.cache_salt)
        s = f"{self._tag}@{self._rank:08x}@{int(k.kind):x}@{k.block_hash.hex()}"
        return f"{s}@{st}" if st else s

    def wrap(self, buf: np.ndarray) -> Any:
        """Zero-copy view of a staging buffer; the store keeps `buf` alive, not LMCache."""
        t = torch.from_numpy(buf)
        shape, u8 = t.shape, torch.uint8
        md = self._Meta(shape, u8, 0, t.numel(), 1, 0, self._fmt, shapes=[shape], dtypes=[u8])
        return self._TMO(t, md, parent_allocator=None)
