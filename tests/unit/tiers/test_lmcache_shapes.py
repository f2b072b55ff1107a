"""Our keys as LMCache sees them: the fast key copies are LMCache's keys, and probes hold no locks.

`LMCacheShapes.object_key` constructs one LMCache key per (kind, salt) and copies it for the
rest; a copy that differed from the constructed key in any field, or in its hash, would send a
probe, read or write to another object (a miss at best, another object's slot at worst). And a
probe of a native adapter "locks" the keys it found until we unlock them: a leak there grows
without bound in a long-running engine.
"""

from __future__ import annotations

import pytest

from himamba.tiers.lmcache_shapes import LMCacheShapes
from himamba.tiers.object_format import ObjectKind, StorageKey
from tests.harness.stores import h, make_store, ns, payload, run

pytest.importorskip("lmcache")


def constructed(shapes: LMCacheShapes, k: StorageKey):
    """The key exactly as LMCache's constructor builds it (no template)."""
    from lmcache.v1.distributed.api import ObjectKey

    from himamba.tiers.object_format import salt_tag

    return ObjectKey(
        chunk_hash=k.block_hash,
        model_name=shapes._tag,
        kv_rank=shapes._rank,
        object_group_id=int(k.kind),
        cache_salt=salt_tag(k.cache_salt),
    )


def test_copied_keys_equal_and_hash_as_constructed_ones_for_every_kind_salt_and_rank():
    for rank in (0, 1):
        shapes = LMCacheShapes(ns(tp_size=2, tp_rank=rank))
        keys = [
            StorageKey(h(i), kind, salt)
            for salt in ("", "e1", "e1+lora-a", "e2")
            for kind in (ObjectKind.KV, ObjectKind.MAMBA)
            for i in range(4)
        ]
        got = [shapes.object_key(k) for k in keys]
        want = [constructed(shapes, k) for k in keys]
        assert got == want
        assert [hash(g) for g in got] == [hash(w) for w in want]
        assert [repr(g) for g in got] == [repr(w) for w in want]
        assert len({hash(g) for g in got}) == len(keys)  # no two keys collapse into one
        # A copy never aliases its template: keys of one kind and salt stay distinct objects.
        assert got[1] is not got[0] and got[1].chunk_hash == h(1)


def test_keys_of_two_namespaces_never_share_a_template():
    a, b = LMCacheShapes(ns("org/a")), LMCacheShapes(ns("org/b"))
    k = StorageKey(h(7), ObjectKind.KV, "e1")
    for _ in range(2):  # the second round is served from the templates
        assert a.object_key(k).model_name != b.object_key(k).model_name
        assert a.object_key(k) == constructed(a, k) and b.object_key(k) == constructed(b, k)


def test_probes_release_every_lock_the_native_adapter_took(tmp_path):
    store = make_store(f"file://{tmp_path}")
    try:
        ad = store._health.adapter
        if not hasattr(ad, "_locked_keys"):
            pytest.skip(f"{type(ad).__name__} keeps no lock table (fs_native did not load)")
        present = [StorageKey(h(i), ObjectKind.KV, "e1") for i in range(0, 12, 2)]
        put = store.submit_put(present, [payload(i, 64) for i in range(6)])
        assert run(store, put).error is None
        probe = [StorageKey(h(i), ObjectKind.KV, "e1") for i in range(12)]
        for _ in range(3):
            r = run(store, store.submit_exists(probe))
            assert r.error is None and list(r.ok) == [i % 2 == 0 for i in range(12)]
        miss = run(store, store.submit_exists([StorageKey(h(99), ObjectKind.MAMBA, "e1")]))
        assert list(miss.ok) == [False]
        assert dict(ad._locked_keys) == {}
    finally:
        store.close()
