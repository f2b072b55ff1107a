"""Storage probes through LMCache's ``valkey`` adapter as one pipelined request, not one per key.

LMCache 0.5.6's ``ValkeyL2Adapter.submit_lookup_and_lock_task`` sends one ``EXISTS`` per key:
one future on its pool of Python threads and one completion callback each. A probe asks for
every block's KV object and Mamba state (2 x blocks keys): on the 3-node loopback cluster of
the tests, 112 keys took 12-15 ms that way and ~1 ms as one non-atomic batch (GLIDE splits a
cluster batch per node: one round trip per node). The per-key threads also need the engine
process's GIL while it schedules, which is where the fleet benchmark's probe tails came from.

``batch_lookups`` gives one adapter instance a lookup that sends all the keys in one GLIDE
batch from the adapter's own pool and publishes the result through the adapter's own
completion path (``_finalize_lookup``: bitmap, lock refcounts, event fd), so everything else
(unlock, loads, stores, health) is LMCache's. Per-key semantics are kept: a key whose command
failed (its node is down) is a miss, the others answer as usual, so a partial outage stays
partial. Those are private parts of the adapter; where any is missing (another LMCache
version) the adapter is left as it is and the log says so once.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)

# The adapter's private parts this relies on.
_ADAPTER_PARTS = ("_pool", "_config", "_lock", "_new_task_id", "_wire_key", "_finalize_lookup")
_POOL_PARTS = ("_executor", "_get_client")


def batch_lookups(adapter: Any) -> bool:
    """Make ``adapter``'s lookups one batch per call; False (adapter unchanged) where it is
    not LMCache's Valkey adapter as this module knows it."""
    if type(adapter).__name__ != "ValkeyL2Adapter":
        return False
    pool = getattr(adapter, "_pool", None)
    missing = [p for p in _ADAPTER_PARTS if not hasattr(adapter, p)]
    missing += [f"_pool.{p}" for p in _POOL_PARTS if not hasattr(pool, p)]
    try:
        from glide_sync import Batch, ClusterBatch
    except ImportError:
        missing.append("glide_sync.Batch")
    if missing:
        log.warning(
            "himamba: the valkey adapter lacks %s; storage probes stay one EXISTS per key",
            ", ".join(missing),
        )
        return False
    cluster = bool(getattr(adapter._config, "cluster_mode", False))
    new_batch: Callable[[], Any] = (
        (lambda: ClusterBatch(is_atomic=False)) if cluster else (lambda: Batch(is_atomic=False))
    )
    per_key = adapter.submit_lookup_and_lock_task

    def submit_lookup_and_lock_task(keys: list[Any], layout: Any) -> Any:
        if getattr(adapter, "_closed", False) or not keys:
            return per_key(keys, layout)  # the adapter's own immediate answers
        with adapter._lock:
            task_id = adapter._new_task_id()
        wire = [adapter._wire_key(k).encode() for k in keys]
        state = types.SimpleNamespace(task_id=task_id, keys=list(keys), per_key_ok=[])
        fut = adapter._pool._executor.submit(_exists_all, adapter._pool, new_batch, wire)
        fut.add_done_callback(lambda f: _publish(adapter, state, f))
        return task_id

    adapter.submit_lookup_and_lock_task = submit_lookup_and_lock_task
    return True


def _exists_all(pool: Any, new_batch: Callable[[], Any], wire: list[bytes]) -> list[bool]:
    """On one of the adapter's pool threads, with that thread's client."""
    batch = new_batch()
    for key in wire:
        batch.exists([key])
    replies = pool._get_client().exec(batch, raise_on_error=False)
    if replies is None or len(replies) != len(wire):
        raise RuntimeError(f"EXISTS batch of {len(wire)} keys answered {replies!r:.80}")
    # A failed command comes back as an exception object in its place: that key is a miss.
    return [isinstance(r, int) and r > 0 for r in replies]


def _publish(adapter: Any, state: types.SimpleNamespace, fut: Future[list[bool]]) -> None:
    """Hand the answer to the adapter's own completion path; a failed batch is all-miss (as
    the adapter's per-key path reports failed keys), never a lookup left hanging."""
    try:
        state.per_key_ok = fut.result()
    except Exception as exc:  # the cluster unreachable, a closed client, a cancel
        log.warning("himamba: a batched EXISTS of %d keys failed: %s", len(state.keys), exc)
        state.per_key_ok = [False] * len(state.keys)
    adapter._finalize_lookup(state)
