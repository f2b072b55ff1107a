"""How our keys and buffers look to LMCache: `ObjectKey`s and zero-copy `TensorMemoryObj`s.

LMCache is imported when this is constructed, not at module import: the scheduler and the
config parser must load without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .object_format import Namespace, StorageKey, salt_tag

_new = object.__new__
# Distinct (kind, salt) pairs remembered: salts are the generation's epoch plus a LoRA tag.
_MAX_TEMPLATES = 4096


class LMCacheShapes:
    """One namespace's mapping of `StorageKey` -> LMCache key, and staging buffer -> memory obj."""

    def __init__(self, namespace: Namespace) -> None:
        from lmcache.v1.distributed.api import ObjectKey
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

        self._ObjectKey, self._Meta, self._TMO = ObjectKey, MemoryObjMetadata, TensorMemoryObj
        self._fmt = MemoryFormat.BINARY
        self._tag, self._rank = namespace.model_tag(), namespace.kv_rank()
        # (kind, salt) -> a key built (and validated) by LMCache's constructor; later keys of
        # the same kind and salt are copies of it with another hash (see `object_key`). None
        # where the key class keeps no per-instance dict (another LMCache): constructor only.
        self._templates: dict[tuple[int, str], Any] | None = {}

    def object_key(self, k: StorageKey) -> Any:
        """LMCache's key for ``k``.

        A storage probe converts two keys per prompt block, and LMCache's frozen dataclass
        validates its model name and salt on every construction (~3 us a key, the largest part
        of a probe's Python work on the store's thread, where it competes with the engine for
        the GIL). Only the
        block hash varies between keys of one kind and salt, so the first such key is
        constructed (and validated) and the rest copy its fields with their own hash:
        equal, and hashing equal, to the constructed key (`test_lmcache_shapes`)."""
        tpls = self._templates
        if tpls is not None:
            tpl = tpls.get((k.kind, k.cache_salt))
            if tpl is not None:
                key = _new(self._ObjectKey)
                d = key.__dict__
                d.update(tpl.__dict__)
                d["chunk_hash"] = k.block_hash
                return key
        key = self._ObjectKey(
            chunk_hash=k.block_hash,
            model_name=self._tag,
            kv_rank=self._rank,
            object_group_id=int(k.kind),
            cache_salt=salt_tag(k.cache_salt),
        )
        if tpls is not None:
            if not isinstance(getattr(key, "__dict__", None), dict):
                self._templates = None
            elif len(tpls) < _MAX_TEMPLATES:
                tpls[(k.kind, k.cache_salt)] = key
        return key

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
