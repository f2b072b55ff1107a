"""The read side of the task pipeline: get (load, then validate), exists (lookup), delete.

    get:    adapter loads into staging buffers -> CPU worker validates -> copy into dst;
            or, into an `ObjectView` the caller lends: adapter loads into it, checked in place
    exists: adapter lookup (per-key bitmap);  delete: adapter delete on its own thread

A get is split into load calls of about `LOAD_CALL_BYTES` so the workers check the first
objects while the adapter still reads the rest. An object that fails validation is deleted;
one the adapter could not load but still lists is unreadable at its size, and deleted too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from .object_format import HEADER_SIZE, StorageKey, key_digest, validate_object
from .pipeline_parts import PipelineParts
from .staging import as_bytes, load_groups
from .storage_records import Batch, BatchKind, OpKind, Task, TaskError, TaskState
from .task_book import OnDone

log = logging.getLogger(__name__)


class GetPath:
    """Loads, lookups and deletes: their adapter calls, completions and validation."""

    def __init__(self, parts: PipelineParts, deleter: Executor) -> None:
        self.ns, self._algo, self._ns_digest = parts.namespace, parts.algo, parts.namespace.digest()
        self._okey, self._wrap = parts.shapes.object_key, parts.shapes.wrap
        self._book, self._calls, self._health = parts.book, parts.calls, parts.health
        self.stats, self._cpu, self._post = parts.stats, parts.cpu, parts.post
        self._deleter = deleter
        self._delete_ids = 0

    # ------------------------------------------------------------------ caller thread
    def submit(self, op: OpKind, keys: Sequence[StorageKey], dsts: Sequence[Any] | None) -> int:
        """get (into `dsts`, each exactly the payload size), exists or delete."""
        bufs = None if dsts is None else [as_bytes(d, writable=True) for d in dsts]
        if bufs is not None and len(bufs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        task = self._book.new(op, list(keys), bufs)
        if not keys:
            return self._book.finish_now(task, None)
        if not self._health.allow():
            return self._book.finish_now(task, TaskError.BREAKER_OPEN)
        self._post(lambda: self.start(task))
        return task.id

    # ------------------------------------------------------------------ driver thread
    def start_internal(
        self,
        op: OpKind,
        keys: list[StorageKey],
        bufs: list[np.ndarray] | None,
        on_done: OnDone,
    ) -> None:
        """Probes, verification and clean-up: past the breaker; none once the store closes."""
        task = self._book.new_internal(op, keys, bufs, on_done)
        if task is not None:
            self.start(task, internal=True)

    def start(self, task: Task, internal: bool = False) -> None:
        if task.state is not TaskState.QUEUED:
            return
        if not internal and not self._health.allow():
            self._book.finish(task, TaskError.BREAKER_OPEN)
            return
        ad = self._health.adapter
        try:
            okeys = [self._okey(k) for k in task.keys]
            if task.op is OpKind.DELETE:
                b = Batch(task, BatchKind.DELETE, list(range(len(okeys))), okeys)
                self._delete_ids += 1
                task.open_batches, did = 1, self._delete_ids
                self._calls.add(BatchKind.DELETE, did, b)
                self._deleter.submit(self._delete, ad, did, b)
            elif task.op is OpKind.EXISTS:
                task.open_batches = 1
                tid = ad.submit_lookup_and_lock_task(okeys, {})
                b = Batch(task, BatchKind.LOOKUP, list(range(len(okeys))), okeys)
                self._calls.add(BatchKind.LOOKUP, tid, b)
            else:
                self._start_loads(task, okeys)
        except Exception:
            log.warning("storage %s submit failed", task.op.value, exc_info=True)
            self._health.outcome(False, f"{task.op.value} submit failed")
            self._book.finish(task, TaskError.ADAPTER)

    def _start_loads(self, task: Task, okeys: list[Any]) -> None:
        assert task.dsts is not None
        dsts = task.dsts
        sizes, lent, groups = load_groups(dsts)
        with task.lock:  # lent batches are counted before any is handed out: a cancel from
            if task.state is not TaskState.QUEUED:  # now on sees them all (`finish`)
                return
            task.state = TaskState.RUNNING
            task.open_batches = len(groups)
            task.lent = sum(lent[idx[0]] for idx in groups)
        batches = []
        for idx in groups:
            lend = lent[idx[0]]
            bufs = [dsts[i].buf if lend else self._calls.staging.get(sizes[i]) for i in idx]
            batches.append(
                Batch(task, BatchKind.LOAD, idx, [okeys[i] for i in idx], bufs, lent=lend)
            )
        for n, b in enumerate(batches):
            if task.finished:  # given up meanwhile: hand nothing more out
                self._calls.free(batches[n:])
                return
            try:
                tid = self._health.adapter.submit_load_task(
                    b.okeys, [self._wrap(s) for s in b.staging]
                )
            except Exception:
                self._calls.free(batches[n:])
                raise
            self._calls.add(BatchKind.LOAD, tid, b)

    def collect(self, adapter: Any, now: float) -> None:
        """Take the adapter's finished load and lookup calls."""
        for kind in (BatchKind.LOAD, BatchKind.LOOKUP):
            for tid in self._calls.call_ids(kind):
                if kind is BatchKind.LOAD:
                    bm = adapter.query_load_result(tid)
                else:
                    bm = adapter.query_lookup_and_lock_result(tid)
                if bm is None:
                    continue
                b = self._calls.pop(kind, tid)
                assert b is not None
                hits = set(bm.get_indices_list())
                bits = [j in hits for j in range(len(b.idx))]
                if any(bits):  # all-miss is not a failure: the keys may simply be gone
                    self._health.outcome(True, "", now - (b.handed_at or now))
                if kind is BatchKind.LOAD and not all(bits):
                    self._health.op_failed("load")  # before the miss is reported
                if kind is BatchKind.LOOKUP:
                    # Native adapters refcount the "locks" of the keys a lookup found,
                    # client-side; the others hold none to release.
                    if hits:
                        adapter.submit_unlock([b.okeys[j] for j in sorted(hits)])
                    if b.task.state is TaskState.RUNNING:
                        self.stats.exists_hits += sum(bits)
                        self.stats.exists_misses += len(bits) - sum(bits)
                    self._book.batch_done(b, bits)
                elif b.task.state is TaskState.RUNNING:
                    self._cpu.submit(self._validate_load, b, bits)
                else:
                    self._calls.free([b])

    def _validate_load(self, b: Batch, bits: list[bool]) -> None:  # CPU worker
        """Check each loaded object, then copy the valid ones into their destinations.

        Neither the checksum nor the copy holds the task's lock, so both workers verify and
        copy sub-batches of one task at once; a copy registers with the task instead, and its
        finish waits for it (a deadline must not hand a buffer back in the middle of a copy).
        An object is copied right after its own check, while its staging bytes are still in
        the CPU cache."""
        task, oks, bad = b.task, [False] * len(b.idx), []
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
                algo=self._algo,
            )
            if why:
                bad.append((i, why))
                continue
            if b.lent:  # checked where it landed: nothing to copy
                oks[j] = True
                continue
            dsts = task.start_copy()
            if dsts is None:
                continue
            try:
                dsts[i][:] = st[HEADER_SIZE:]
                oks[j] = True
            finally:
                task.end_copy()
        self._post(lambda: self._load_validated(b, bits, oks, bad))

    def _load_validated(
        self, b: Batch, bits: list[bool], oks: list[bool], bad: list[tuple[int, str]]
    ) -> None:
        task, st = b.task, self.stats
        st.bytes_read += sum(s.nbytes for s, o in zip(b.staging, oks, strict=True) if o)
        self._calls.free([b])
        for _, why in bad:
            st.count_invalid(why)
        if bad:
            self.delete_bad([task.keys[i] for i, _ in bad])
        unread = [task.keys[i] for j, i in enumerate(b.idx) if not bits[j]]
        if unread and task.on_done is None:
            if self._health.allow():
                self.start_internal(OpKind.EXISTS, unread, None, self._verified)
            else:
                self._health.defer_check(unread, self._verified)
        st.get_hits += sum(oks)
        st.get_misses += len(oks) - sum(oks)
        self._book.batch_done(b, oks)

    def _verified(self, v: Task, error: TaskError | None) -> None:
        """A key the adapter could not load but still lists is unreadable at its size: drop it."""
        present = [k for k, ok in zip(v.keys, v.ok, strict=True) if ok]
        if present and error is None:
            self.stats.unreadable += len(present)
            self.delete_bad(present)

    def delete_bad(self, keys: list[StorageKey]) -> None:
        self.stats.deleted_bad += len(keys)
        if not self._health.defer_deletes(keys):
            self.start_internal(OpKind.DELETE, keys, None, lambda t, e: None)

    def _delete(self, adapter: Any, did: int, b: Batch) -> None:  # deleter thread
        try:
            adapter.delete(b.okeys)
            ok = True
        except Exception:
            log.warning("storage delete failed", exc_info=True)
            ok = False
        self._post(lambda: self._deleted(did, b, ok))

    def _deleted(self, did: int, b: Batch, ok: bool) -> None:
        if self._calls.holds(BatchKind.DELETE, did, b):  # else: its adapter was replaced
            self._calls.pop(BatchKind.DELETE, did)
            self._book.batch_done(b, [ok] * len(b.idx))
