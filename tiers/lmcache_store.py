"""Async byte store over one LMCache 0.5.6 L2 adapter, hardened for what those adapters lack.

Callers (scheduler: exists; worker: put/get) only enqueue; one driver thread owns the adapter,
and `poll()` hands back finished tasks, so vLLM's step loop never waits on storage. Added on top
of the adapter: exact-size batches (the RESP client rejects mixed sizes and desyncs after), a
validated header per object, per-task deadlines, and a circuit breaker that replaces the adapter
(the RESP client never reconnects). Adapters only ever see our own staging buffers: a deadline
miss frees the caller's pool slot at once while the staging buffer stays referenced
("quarantined") until the adapter finishes with it or is closed; freeing it early corrupts the heap.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import select
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .circuit_breaker import BreakerState, CircuitBreaker
from .object_format import (
    HEADER_SIZE,
    Namespace,
    ObjectKind,
    StorageKey,
    encode_object,
    key_digest,
    resolve_algo,
    salt_tag,
    stored_size,
    validate_object,
)
from .storage_config import StorageConfig
from .storage_records import Batch, StagingPool, StoreStats, Task, TaskResult, as_bytes, by_size

log = logging.getLogger(__name__)
_L2 = "lmcache.v1.distributed.l2_adapters"
_PROBE_PAYLOAD = b"himamba\x01"


def create_lmcache_adapter(spec: dict[str, Any]) -> Any:
    """Build an L2 adapter, importing only its own module (the lazy loader would pull in
    aerospike, bigtable... first). `fs_native` falls back to pure-Python `fs` if its C++ lib fails."""
    t = spec["type"]
    try:
        importlib.import_module(f"{_L2}.{t.replace('-', '_')}_l2_adapter")
    except ImportError:
        pass  # plugins and odd names: LMCache's registry may still know the type
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

    try:
        return create_l2_adapter_from_registry(get_l2_adapter_config_class(t).from_dict(spec))
    except (ImportError, RuntimeError):
        if t != "fs_native":
            raise
        log.warning("fs_native unavailable, using LMCache's pure-Python fs adapter", exc_info=True)
        fs = {"type": "fs", "base_path": spec["base_path"], "relative_tmp_dir": "tmp"}
        return create_lmcache_adapter(fs)


class LMCacheStore:
    """Non-blocking put / get / exists / delete of exact-size objects keyed by `StorageKey`."""

    def __init__(
        self,
        cfg: StorageConfig,
        namespace: Namespace,
        adapter_factory: Callable[[dict[str, Any]], Any] = create_lmcache_adapter,
    ) -> None:
        from lmcache.v1.distributed.api import ObjectKey
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

        self._ObjectKey, self._Meta, self._TMO, self._fmt = (
            ObjectKey,
            MemoryObjMetadata,
            TensorMemoryObj,
            MemoryFormat.BINARY,
        )
        self.cfg, self.ns = cfg, namespace
        self._factory = adapter_factory
        self._tag, self._rank, self._ns_digest = ns_tag(namespace)
        self._algo = resolve_algo(cfg.checksum)
        self._probe_key = StorageKey(uuid.uuid4().bytes, ObjectKind.PROBE)
        self.stats = StoreStats()
        self._breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown_s)
        self._staging = StagingPool(cfg.staging_pool_mb << 20)
        self._pool = ThreadPoolExecutor(cfg.num_workers, thread_name_prefix="himamba-l3-cpu")
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="himamba-l3-del")
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._tasks: dict[int, Task] = {}
        self._pending: dict[tuple[str, int], Batch] = {}
        self._quarantine: dict[int, list[Batch]] = {}
        self._results: dict[int, TaskResult] = {}
        self._cv = threading.Condition()
        self._next_id, self._id_lock = 0, threading.Lock()
        self._gen, self._closed, self._stop = 0, False, threading.Event()
        self._adapter: Any = None
        self._adapter_fds: list[int] = []
        self._probing = False
        self._desync_prone = cfg.adapter.get("type") == "resp"
        self._deferred_deletes: list[StorageKey] = []
        self._last_probe = time.monotonic()
        try:
            self._install(adapter_factory(cfg.adapter))
        except ValueError:
            raise  # a bad adapter spec is a config error: fail at startup
        except Exception as e:  # storage down at startup must not stop serving
            log.warning("storage adapter unavailable at startup: %s", e)
            self._breaker.trip(f"create failed: {e}")
        self._driver = threading.Thread(target=self._run, name="himamba-l3-driver", daemon=True)
        self._driver.start()

    # ------------------------------------------------------------------ public API
    def submit_put(self, keys: Sequence[StorageKey], payloads: Sequence[Any]) -> int:
        """Store payloads (each must stay unchanged until this task completes)."""
        return self._submit("put", keys, [as_bytes(p) for p in payloads])

    def submit_get(self, keys: Sequence[StorageKey], dsts: Sequence[Any]) -> int:
        """Load into dsts of the exact payload size; a key's dst is written only if it validates."""
        return self._submit("get", keys, [as_bytes(d) for d in dsts])

    def submit_exists(self, keys: Sequence[StorageKey]) -> int:
        return self._submit("exists", keys, None)

    def submit_delete(self, keys: Sequence[StorageKey]) -> int:
        return self._submit("delete", keys, None)

    def poll(self) -> list[TaskResult]:
        """All tasks finished since the last call (never blocks on storage)."""
        with self._cv:
            out = list(self._results.values())
            self._results.clear()
        return out

    def wait(self, task_id: int, timeout_s: float | None = None) -> TaskResult | None:
        """Block for one task (tests, benchmarks, shutdown paths; not for the step loop)."""
        with self._cv:
            self._cv.wait_for(lambda: task_id in self._results, timeout_s)
            return self._results.pop(task_id, None)

    @property
    def breaker_state(self) -> BreakerState:
        return self._breaker.state

    def quarantined_buffers(self) -> int:
        """Staging buffers still lent to an adapter for tasks already reported finished."""
        q = sum(len(b.staging) for bs in list(self._quarantine.values()) for b in bs)
        return q + sum(
            len(b.staging) for b in list(self._pending.values()) if b.task.state != "running"
        )

    def object_key_string(self, key: StorageKey) -> str:
        """The adapter's key for `key` (fs: file name without '.data'; resp: the Redis key)."""
        st = salt_tag(key.cache_salt)
        s = f"{self._tag}@{self._rank:08x}@{int(key.kind):x}@{key.block_hash.hex()}"
        return f"{s}@{st}" if st else s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake()
        self._driver.join(timeout=10)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._adapter is not None and self._breaker.allow():
            try:  # best effort; at interpreter exit the executor refuses new work
                fut = self._deleter.submit(self._adapter.delete, [self._okey(self._probe_key)])
                fut.result(timeout=2)
            except Exception:
                pass
        self._deleter.shutdown(wait=False, cancel_futures=True)
        for t in list(self._tasks.values()):
            self._finish(t, "closed")
        if self._adapter is not None:
            self._adapter.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ------------------------------------------------------------------ submission
    def _submit(self, op: str, keys: Sequence[StorageKey], bufs: list[np.ndarray] | None) -> int:
        if self._closed:
            raise RuntimeError("LMCacheStore is closed")
        if bufs is not None and len(bufs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        task = self._new_task(op, list(keys), bufs)
        if not self._breaker.allow() or not keys:
            self._finish(task, None if not keys else "breaker_open")
        else:
            self._post(lambda: self._start(task))
        return task.id

    def _new_task(self, op: str, keys: list[StorageKey], bufs: Any, on_done: Any = None) -> Task:
        with self._id_lock:
            tid, self._next_id = self._next_id, self._next_id + 1
        dl = time.monotonic() + self.cfg.op_deadline_s
        return Task(tid, op, keys, bufs, dl, [False] * len(keys), on_done)

    def _post(self, fn: Callable[[], None]) -> None:
        self._inbox.put(fn)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _okey(self, k: StorageKey) -> Any:
        return self._ObjectKey(
            chunk_hash=k.block_hash,
            model_name=self._tag,
            kv_rank=self._rank,
            object_group_id=int(k.kind),
            cache_salt=salt_tag(k.cache_salt),
        )

    def _wrap(self, buf: np.ndarray) -> Any:
        t = torch.from_numpy(buf)
        shape, u8 = t.shape, torch.uint8
        md = self._Meta(shape, u8, 0, t.numel(), 1, 0, self._fmt, shapes=[shape], dtypes=[u8])
        return self._TMO(t, md, parent_allocator=None)  # zero-copy view; we own the buffer

    # ------------------------------------------------------------------ driver thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._wake_r, *self._adapter_fds], [], [], 0.05)
            except (OSError, ValueError):
                ready = []
            for fd in ready:
                try:
                    os.read(fd, 4096 if fd == self._wake_r else 8)
                except OSError:
                    pass
            try:
                while True:
                    self._inbox.get_nowait()()
            except queue.Empty:
                pass
            except Exception:
                log.exception("storage driver step failed")
            try:
                self._collect()
                self._maintain()
            except Exception:
                log.exception("storage driver poll failed")

    def _start(self, task: Task, internal: bool = False) -> None:
        if task.state != "new":
            return
        if not internal and not self._breaker.allow():
            return self._finish(task, "breaker_open")
        task.state = "running"
        self._tasks[task.id] = task
        if task.op == "put":
            self._pool.submit(self._prepare_put, task)
            return
        try:
            okeys = [self._okey(k) for k in task.keys]
            if task.op == "delete":
                self._deleter.submit(self._delete, self._adapter, okeys, task)
            elif task.op == "exists":
                tid = self._adapter.submit_lookup_and_lock_task(okeys, {})
                self._add_batch("lookup", tid, Batch(task, list(range(len(okeys))), okeys, []))
            else:
                assert task.bufs is not None
                for idx in by_size(task.bufs):
                    st = [self._staging.get(stored_size(task.bufs[i].nbytes)) for i in idx]
                    tid = self._adapter.submit_load_task(
                        [okeys[i] for i in idx], [self._wrap(s) for s in st]
                    )
                    self._add_batch("load", tid, Batch(task, idx, [okeys[i] for i in idx], st))
        except Exception:
            log.warning("storage %s submit failed", task.op, exc_info=True)
            self._outcome(False, f"{task.op} submit failed")
            self._finish(task, "adapter")

    def _add_batch(self, kind: str, tid: int, b: Batch) -> None:
        self._pending[(kind, tid)] = b
        b.task.open_batches += 1

    def _prepare_put(self, task: Task) -> None:  # pool thread: header + checksum + copy
        staged: list[np.ndarray] = []
        with task.lock:  # the deadline cannot fire while we still read the caller's memory
            if task.state != "running" or task.bufs is None:
                return
            for k, src in zip(task.keys, task.bufs, strict=True):
                out = self._staging.get(stored_size(src.nbytes))
                encode_object(
                    memoryview(out),
                    memoryview(src),
                    kind=k.kind,
                    layout_digest=self._ns_digest,
                    key_dig=key_digest(self.ns, k),
                    algo=self._algo,
                )
                staged.append(out)
            task.bufs = None  # caller's slot is free from here on
        self._post(lambda: self._submit_store(task, staged))

    def _submit_store(self, task: Task, staged: list[np.ndarray]) -> None:
        if task.state != "running" or self._adapter is None:
            self._staging.put(staged)
            return
        try:
            for idx in by_size(staged):
                okeys = [self._okey(task.keys[i]) for i in idx]
                st = [staged[i] for i in idx]
                tid = self._adapter.submit_store_task(okeys, [self._wrap(s) for s in st])
                self._add_batch("store", tid, Batch(task, idx, okeys, st))
        except Exception:
            log.warning("storage put submit failed", exc_info=True)
            self._outcome(False, "put submit failed")
            self._finish(task, "adapter")

    def _collect(self) -> None:
        ad = self._adapter
        if ad is None or not self._pending:
            return
        for tid, res in ad.pop_completed_store_tasks().items():
            b = self._pending.pop(("store", tid), None)
            if b is None:
                continue
            ok = res.is_successful()
            self._staging.put(b.staging)
            self._outcome(ok, "store failed")
            n = len(b.idx)
            self.stats.put_objects += n if ok else 0
            self.stats.put_failed += 0 if ok else n
            self.stats.bytes_written += sum(s.nbytes for s in b.staging) if ok else 0
            self._batch_done(b, [ok] * n)
        for key in [k for k in self._pending if k[0] != "store"]:
            kind, tid = key
            bm = (
                ad.query_load_result(tid)
                if kind == "load"
                else ad.query_lookup_and_lock_result(tid)
            )
            if bm is None:
                continue
            b = self._pending.pop(key)
            hits = set(bm.get_indices_list())
            bits = [j in hits for j in range(len(b.idx))]
            if kind == "lookup":
                ad.submit_unlock(b.okeys)  # native adapters refcount "locks" client-side
                if any(bits):
                    self._outcome(True, "")
                self._batch_done(b, bits)
            else:
                if any(bits):  # all-miss loads are not failures: keys may simply be gone
                    self._outcome(True, "")
                self._pool.submit(self._finish_get, b, bits)

    def _finish_get(self, b: Batch, bits: list[bool]) -> None:  # pool thread: validate + copy
        task, oks, bad = b.task, [False] * len(b.idx), []
        with task.lock:
            live = task.state == "running" and task.bufs is not None
            for j, i in enumerate(b.idx):
                if not bits[j]:
                    continue
                k, st = task.keys[i], b.staging[j]
                why = validate_object(
                    memoryview(st),
                    kind=k.kind,
                    payload_nbytes=st.nbytes - HEADER_SIZE,
                    layout_digest=self._ns_digest,
                    key_dig=key_digest(self.ns, k),
                )
                if why:
                    bad.append((i, why))
                elif live:
                    task.bufs[i][:] = st[HEADER_SIZE:]  # type: ignore[index]
                    oks[j] = True
        self._post(lambda: self._get_validated(b, bits, oks, bad))

    def _get_validated(self, b: Batch, bits: list[bool], oks: list[bool], bad: list) -> None:
        self._staging.put(b.staging)
        task, st = b.task, self.stats
        for _, why in bad:
            st.invalid[why] = st.invalid.get(why, 0) + 1
        if bad:
            self._delete_bad([task.keys[i] for i, _ in bad])
        unread = [task.keys[i] for j, i in enumerate(b.idx) if not bits[j]]
        if unread and self._breaker.allow() and task.on_done is None:
            v = self._new_task("exists", unread, None, on_done=self._verified)
            self._start(v, internal=True)
        st.get_hits += sum(oks)
        st.get_misses += len(oks) - sum(oks)
        st.bytes_read += sum(s.nbytes for s, o in zip(b.staging, oks, strict=True) if o)
        self._batch_done(b, oks)

    def _verified(self, v: Task, error: str | None) -> None:
        """A key the adapter could not load but still lists is unreadable at its size: drop it."""
        present = [k for k, ok in zip(v.keys, v.ok, strict=True) if ok]
        if present and error is None:
            self.stats.unreadable += len(present)
            self._delete_bad(present)

    def _delete_bad(self, keys: list[StorageKey]) -> None:
        self.stats.deleted_bad += len(keys)
        if self._desync_prone:
            # LMCache's RESP client leaves a size-mismatched reply unread: later replies on that
            # connection belong to earlier requests. Only a fresh adapter is trustworthy, and
            # the delete waits for it.
            self._deferred_deletes.extend(keys)
            if self._breaker.allow():
                self._breaker.trip("bad object on a RESP connection")
                self.stats.breaker_opens += 1
            return
        self._start(self._new_task("delete", keys, None, on_done=lambda t, e: None), internal=True)

    def _delete(self, adapter: Any, okeys: list[Any], task: Task) -> None:  # deleter thread
        try:
            adapter.delete(okeys)
            ok = True
        except Exception:
            log.warning("storage delete failed", exc_info=True)
            ok = False
        self._post(lambda: self._finish(task, None, [ok] * len(okeys)))

    def _batch_done(self, b: Batch, oks: list[bool]) -> None:
        t = b.task
        if t.state != "running":
            return
        for j, i in enumerate(b.idx):
            t.ok[i] = oks[j]
        t.open_batches -= 1
        if t.open_batches == 0:
            if t.op == "exists":
                self.stats.exists_hits += sum(t.ok)
                self.stats.exists_misses += len(t.ok) - sum(t.ok)
            self._finish(t, None)

    def _finish(self, t: Task, error: str | None, ok: list[bool] | None = None) -> None:
        with t.lock:  # never while a worker is copying into or out of the caller's buffers
            if t.state in ("done", "expired"):
                return
            t.state = "expired" if error == "deadline" else "done"
            t.bufs = None
        self._tasks.pop(t.id, None)
        res_ok = tuple(ok if ok is not None else (t.ok if error is None else [False] * len(t.ok)))
        t.ok = list(res_ok)
        if t.on_done is not None:
            t.on_done(t, error)
            return
        with self._cv:
            self._results[t.id] = TaskResult(t.id, t.op, res_ok, error)
            self._cv.notify_all()

    # ------------------------------------------------------------------ health
    def _outcome(self, ok: bool, reason: str) -> None:
        if ok:
            self._breaker.record_success()
        elif self._breaker.record_failure(reason):
            self.stats.breaker_opens += 1
            log.warning("storage breaker open: %s", reason)

    def _maintain(self) -> None:
        now = time.monotonic()
        for t in [t for t in self._tasks.values() if t.deadline <= now]:
            if t.lock.acquire(blocking=False):  # busy = a worker is mid-copy; next round
                try:
                    self._finish(t, "deadline")
                finally:
                    t.lock.release()
                self.stats.deadline_expired += 1
                self._outcome(False, f"{t.op} deadline")
        state = self._breaker.state
        if state is BreakerState.OPEN and self._breaker.should_probe():
            if self._recreate():
                self._probe()
        elif state is BreakerState.CLOSED and not self._probing:
            if now - self._last_probe >= self.cfg.probe_interval_s:
                self._probe()

    def _probe(self) -> None:
        """Write then read back a tiny object: the only way to see a silently dead RESP client."""
        self._probing, self._last_probe = True, time.monotonic()
        payload = np.frombuffer(bytearray(_PROBE_PAYLOAD), dtype=np.uint8)
        dst = np.zeros(len(_PROBE_PAYLOAD), dtype=np.uint8)

        def got(t: Task, err: str | None) -> None:
            self._probe_done(bool(err is None and t.ok[0] and bytes(dst) == _PROBE_PAYLOAD))

        def stored(t: Task, err: str | None) -> None:
            if err is not None or not t.ok[0]:
                return self._probe_done(False)
            self._start(self._new_task("get", [self._probe_key], [dst], got), internal=True)

        self._start(self._new_task("put", [self._probe_key], [payload], stored), internal=True)

    def _probe_done(self, ok: bool) -> None:
        self._probing, self._last_probe = False, time.monotonic()
        if ok:
            self.stats.probes_ok += 1
        else:
            self.stats.probes_failed += 1
        if self._breaker.state is BreakerState.PROBING:
            self._breaker.probe_result(ok)
            log.warning("storage probe after recreate: %s", "recovered" if ok else "still down")
            if ok and self._deferred_deletes:
                keys, self._deferred_deletes = self._deferred_deletes, []
                self._start(self._new_task("delete", keys, None, lambda t, e: None), internal=True)
        elif not ok and self._breaker.allow():
            self._breaker.trip("health probe failed")
            self.stats.breaker_opens += 1
            log.warning("storage breaker open: health probe failed")

    def _install(self, adapter: Any) -> None:
        self._adapter, self._gen = adapter, self._gen + 1
        self._adapter_fds = [
            adapter.get_store_event_fd(),
            adapter.get_lookup_and_lock_event_fd(),
            adapter.get_load_event_fd(),
        ]

    def _recreate(self) -> bool:
        """Swap in a fresh adapter; the old one is closed off-thread, its buffers held till then."""
        old, gen, batches = self._adapter, self._gen, list(self._pending.values())
        self._pending.clear()
        self._adapter, self._adapter_fds, self._probing = None, [], False
        for b in batches:
            if b.task.state == "running":
                self._finish(b.task, "adapter_recreated")
        self._quarantine[gen] = batches

        def close_old() -> None:
            try:
                if old is not None:
                    old.close()
            except Exception:
                log.warning("closing old storage adapter failed", exc_info=True)
            self._post(lambda: self._quarantine.pop(gen, None))  # now safe to free

        threading.Thread(target=close_old, name="himamba-l3-close", daemon=True).start()
        try:
            self._install(self._factory(self.cfg.adapter))
        except Exception as e:
            log.warning("recreating storage adapter failed: %s", e)
            self._breaker.probe_result(False, f"create failed: {e}")
            return False
        self.stats.adapter_recreations += 1
        return True


def ns_tag(ns: Namespace) -> tuple[str, int, bytes]:
    return ns.model_tag(), ns.kv_rank(), ns.digest()
