"""The storage task pipeline: from a caller's submit to its `TaskResult`.

    put:    caller copies payload into a staging buffer (budgeted) -> CPU worker seals the
            header + checksum -> put queue -> adapter (at most `adapter_put_depth` batches)
    get:    adapter loads into staging buffers -> CPU worker validates -> copy into dst;
            or, into an `ObjectView` the caller lends: adapter loads into it, checked in place
    exists: adapter lookup (per-key bitmap);  delete: adapter delete on its own thread

Tasks are split into batches of one object size (LMCache's RESP client rejects mixed sizes
and desyncs after). A batch's deadline runs from the moment the adapter gets it, so a backlog
in the checksum workers or the put queue never reads as slow storage. Everything except
`submit*`, `poll` and `wait` (caller threads) and the sealing/validation jobs (CPU workers)
runs on the store's driver thread. Whether the adapter may be used, and which adapter that
is, is decided by `AdapterHealth`; this module only reports outcomes to it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .adapter_health import AdapterHealth
from .lmcache_shapes import LMCacheShapes
from .object_format import (
    HEADER_SIZE,
    Namespace,
    StorageKey,
    key_digest,
    resolve_algo,
    seal_object,
    stored_size,
    validate_object,
)
from .staging import (
    StagingPool,
    WriteBudget,
    as_bytes,
    as_segments,
    by_size,
    copy_segments,
    load_groups,
)
from .storage_config import StorageConfig
from .storage_records import (
    Batch,
    BatchKind,
    LentViews,
    OpKind,
    StoreStats,
    Task,
    TaskError,
    TaskResult,
    TaskState,
)
from .thread_priority import initializer

log = logging.getLogger(__name__)
_FINISHED = (TaskState.DONE, TaskState.EXPIRED)


class TaskPipeline:
    """Submission, staging, batching, adapter calls, validation and completion of tasks."""

    def __init__(
        self,
        cfg: StorageConfig,
        namespace: Namespace,
        health: AdapterHealth,
        stats: StoreStats,
        post: Callable[[Callable[[], None]], None],
    ) -> None:
        self.cfg, self.ns, self.stats = cfg, namespace, stats
        self._health, self._post = health, post
        self.shapes = LMCacheShapes(namespace)
        self._okey, self._wrap = self.shapes.object_key, self.shapes.wrap
        self._ns_digest = namespace.digest()
        self._algo = resolve_algo(cfg.checksum)
        self.staging = StagingPool(cfg.staging_pool_mb << 20)
        self.budget = WriteBudget(cfg.write_buffer_mb << 20)
        background = initializer(cfg.thread_nice)
        self._cpu = ThreadPoolExecutor(
            cfg.num_workers, thread_name_prefix="himamba-l3-cpu", initializer=background
        )
        self._deleter = ThreadPoolExecutor(
            1, thread_name_prefix="himamba-l3-del", initializer=background
        )
        self._ids = itertools.count()
        self._delete_ids = itertools.count()
        # Tasks not yet finished, from any thread's point of view (close() finishes them all).
        self._live: dict[int, Task] = {}
        self._live_lock = threading.Lock()
        # Driver-thread state.
        self._pending: dict[tuple[BatchKind, int], Batch] = {}  # with the adapter
        self._put_queue: deque[Batch] = deque()  # sealed, waiting for an adapter slot
        self._sweep_queue = False  # a put failed as a whole: drop its queued batches
        self._results: dict[int, TaskResult] = {}
        self.lent = LentViews()  # gets reported while the adapter held their ObjectViews
        self._cv = threading.Condition()
        self._closed = False

    # ------------------------------------------------------------------ caller threads
    def submit_put(self, keys: Sequence[StorageKey], payloads: Sequence[Any]) -> int:
        """Copy payloads into store memory now (the caller may reuse its buffers on return);
        refuse the whole put with BACKPRESSURE if it does not fit the write buffer."""
        self._check_open()
        segs = [as_segments(p) for p in payloads]
        if len(segs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(segs)} payloads")
        task = self._new_task(OpKind.PUT, list(keys), None)
        if not keys:
            return self._finish_now(task, None)
        if not self._health.allow():
            return self._finish_now(task, TaskError.BREAKER_OPEN)
        sizes = [stored_size(sum(s.nbytes for s in seg)) for seg in segs]
        if not self.budget.try_reserve(sum(sizes)):
            self.stats.puts_skipped += len(keys)
            return self._finish_now(task, TaskError.BACKPRESSURE)
        try:
            batches = self._stage_puts(task, segs, sizes)
        except BaseException:  # e.g. MemoryError: give the budget back, report, re-raise
            self.budget.release(sum(sizes))
            self._finish(task, TaskError.BACKPRESSURE)
            raise
        self._post(lambda: self._start_put(task, batches))
        return task.id

    def submit(self, op: OpKind, keys: Sequence[StorageKey], dsts: Sequence[Any] | None) -> int:
        """get (into `dsts`, each exactly the payload size), exists or delete."""
        self._check_open()
        bufs = None if dsts is None else [as_bytes(d, writable=True) for d in dsts]
        if bufs is not None and len(bufs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        task = self._new_task(op, list(keys), bufs)
        if not keys:
            return self._finish_now(task, None)
        if not self._health.allow():
            return self._finish_now(task, TaskError.BREAKER_OPEN)
        self._post(lambda: self._start(task))
        return task.id

    def cancel(self, task_id: int) -> bool:
        """Finish a live task now (any thread): copies into its destinations that already
        started are waited out, none starts after, so the caller may reuse them at once.
        True if some were `ObjectView`s still lent to the adapter (released later)."""
        with self._live_lock:
            task = self._live.get(task_id)
        if task is not None:
            self._finish(task, TaskError.CANCELLED)
        return self.lent.is_held(task_id)  # it may have been held since a deadline, too

    def poll(self) -> list[TaskResult]:
        with self._cv:
            out = list(self._results.values())
            self._results.clear()
        return out

    def wait(self, task_id: int, timeout_s: float | None) -> TaskResult | None:
        with self._cv:
            self._cv.wait_for(lambda: task_id in self._results, timeout_s)
            return self._results.pop(task_id, None)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("LMCacheStore is closed")

    def _new_task(
        self,
        op: OpKind,
        keys: list[StorageKey],
        dsts: list[np.ndarray] | None,
        on_done: Callable[[Task, TaskError | None], None] | None = None,
    ) -> Task:
        task = Task(next(self._ids), op, keys, dsts, [False] * len(keys), on_done)
        with self._live_lock:
            self._live[task.id] = task
        return task

    def _finish_now(self, task: Task, error: TaskError | None) -> int:
        self._finish(task, error)
        return task.id

    def _stage_puts(
        self, task: Task, segs: list[list[np.ndarray]], sizes: list[int]
    ) -> list[Batch]:
        """The one copy of a put: caller memory -> staging buffer, after the header space."""
        batches = []
        for idx in by_size(sizes):
            staging = []
            for i in idx:
                buf = self.staging.get(sizes[i])
                copy_segments(buf[HEADER_SIZE:], segs[i])
                staging.append(buf)
            okeys = [self._okey(task.keys[i]) for i in idx]
            batches.append(
                Batch(task, BatchKind.STORE, idx, okeys, staging, reserved=sizes[idx[0]] * len(idx))
            )
        task.open_batches = len(batches)
        return batches

    # ------------------------------------------------------------------ internal ops (driver)
    def submit_internal(
        self,
        op: OpKind,
        keys: list[StorageKey],
        bufs: list[np.ndarray] | None,
        on_done: Callable[[Task, TaskError | None], None],
    ) -> None:
        """Health probes, verification and clean-up: they bypass the breaker and the queue."""
        if op is OpKind.PUT:
            assert bufs is not None
            task = self._new_task(op, keys, None, on_done)
            sizes = [stored_size(b.nbytes) for b in bufs]
            self.budget.try_reserve(sum(sizes), force=True)
            batches = self._stage_puts(task, [[b] for b in bufs], sizes)
            for b in batches:
                self._seal(b)
                self._hand_store(b)
        else:
            self._start(self._new_task(op, keys, bufs, on_done), internal=True)

    # ------------------------------------------------------------------ driver thread
    def _start_put(self, task: Task, batches: list[Batch]) -> None:
        if task.state in _FINISHED or not self._health.allow():
            self.free_batches(batches)
            self._finish(task, TaskError.BREAKER_OPEN)
            return
        self._cpu.submit(self._seal_all, task, batches)

    def _seal_all(self, task: Task, batches: list[Batch]) -> None:  # CPU worker
        for b in batches:
            self._seal(b)
        self._post(lambda: self._sealed(task, batches))

    def _seal(self, b: Batch) -> None:
        for i, buf in zip(b.idx, b.staging, strict=True):
            k = b.task.keys[i]
            seal_object(
                memoryview(buf),
                kind=k.kind,
                layout_digest=self._ns_digest,
                key_dig=key_digest(self.ns, k),
                algo=self._algo,
            )

    def _sealed(self, task: Task, batches: list[Batch]) -> None:
        if task.state in _FINISHED:
            self.free_batches(batches)
        else:
            self._put_queue.extend(batches)

    def dispatch_puts(self) -> None:
        """Hand queued puts to the adapter while it has room; fail them all if it may not be used."""
        if self._sweep_queue:
            self._sweep_queue = False
            dead = [b for b in self._put_queue if b.task.state in _FINISHED]
            if dead:
                self._put_queue = deque(b for b in self._put_queue if b.task.state not in _FINISHED)
                self.free_batches(dead)
        if not self._put_queue:
            return
        if not self._health.allow():
            queued, self._put_queue = list(self._put_queue), deque()
            self.free_batches(queued)
            for b in queued:
                self._finish(b.task, TaskError.BREAKER_OPEN)
            return
        at_adapter = sum(1 for kind, _ in self._pending if kind is BatchKind.STORE)
        while self._put_queue and at_adapter < self.cfg.adapter_put_depth:
            b = self._put_queue.popleft()
            if b.task.state in _FINISHED:
                self.free_batches([b])
                continue
            self._hand_store(b)
            at_adapter += 1

    def _hand_store(self, b: Batch) -> None:
        task = b.task
        try:
            tid = self._health.adapter.submit_store_task(
                b.okeys, [self._wrap(s) for s in b.staging]
            )
        except Exception:
            log.warning("storage put submit failed", exc_info=True)
            self.free_batches([b])
            self._health.outcome(False, "put submit failed")
            self._finish(task, TaskError.ADAPTER)
            return
        self._add(BatchKind.STORE, tid, b)

    def _start(self, task: Task, internal: bool = False) -> None:
        if task.state is not TaskState.QUEUED:
            return
        if not internal and not self._health.allow():
            return self._finish(task, TaskError.BREAKER_OPEN)
        ad = self._health.adapter
        try:
            okeys = [self._okey(k) for k in task.keys]
            if task.op is OpKind.DELETE:
                b = Batch(task, BatchKind.DELETE, list(range(len(okeys))), okeys)
                task.open_batches, did = 1, next(self._delete_ids)
                self._add(BatchKind.DELETE, did, b)
                self._deleter.submit(self._delete, ad, did, b)
            elif task.op is OpKind.EXISTS:
                task.open_batches = 1
                tid = ad.submit_lookup_and_lock_task(okeys, {})
                self._add(
                    BatchKind.LOOKUP,
                    tid,
                    Batch(task, BatchKind.LOOKUP, list(range(len(okeys))), okeys),
                )
            else:
                self._start_loads(task, okeys)
        except Exception:
            log.warning("storage %s submit failed", task.op.value, exc_info=True)
            self._health.outcome(False, f"{task.op.value} submit failed")
            self._finish(task, TaskError.ADAPTER)

    def _start_loads(self, task: Task, okeys: list[Any]) -> None:
        assert task.dsts is not None
        dsts = task.dsts
        sizes, lent, groups = load_groups(dsts)
        with task.lock:  # lent batches are counted before any is handed out: a cancel from
            if task.state is not TaskState.QUEUED:  # now on sees them all (`_finish`)
                return
            task.state = TaskState.RUNNING
            task.open_batches = len(groups)
            task.lent = sum(lent[idx[0]] for idx in groups)
        batches = []
        for idx in groups:
            lend = lent[idx[0]]
            bufs = [dsts[i].buf if lend else self.staging.get(sizes[i]) for i in idx]
            batches.append(
                Batch(task, BatchKind.LOAD, idx, [okeys[i] for i in idx], bufs, lent=lend)
            )
        for n, b in enumerate(batches):
            if task.state in _FINISHED:  # given up meanwhile: hand nothing more out
                self.free_batches(batches[n:])
                return
            try:
                tid = self._health.adapter.submit_load_task(
                    b.okeys, [self._wrap(s) for s in b.staging]
                )
            except Exception:
                self.free_batches(batches[n:])
                raise
            self._add(BatchKind.LOAD, tid, b)

    def _add(self, kind: BatchKind, tid: int, b: Batch) -> None:
        b.handed_at = time.monotonic()
        self._pending[(kind, tid)] = b
        if b.task.state is TaskState.QUEUED:
            b.task.state = TaskState.RUNNING

    def collect(self) -> None:
        """Take the adapter's finished calls (driver thread, after its eventfds fired)."""
        ad = self._health.adapter
        if ad is None or not self._pending:
            return
        now = time.monotonic()
        for tid, res in ad.pop_completed_store_tasks().items():
            b = self._pending.pop((BatchKind.STORE, tid), None)
            if b is None:
                continue
            ok, n, nbytes = res.is_successful(), len(b.idx), sum(s.nbytes for s in b.staging)
            self.free_batches([b])
            self._health.outcome(ok, "store failed", now - (b.handed_at or now))
            self.stats.put_objects += n if ok else 0
            self.stats.put_failed += 0 if ok else n
            self.stats.bytes_written += nbytes if ok else 0
            self._batch_done(b, [ok] * n)
        for key in [k for k in self._pending if k[0] in (BatchKind.LOAD, BatchKind.LOOKUP)]:
            kind, tid = key
            if kind is BatchKind.LOAD:
                bm = ad.query_load_result(tid)
            else:
                bm = ad.query_lookup_and_lock_result(tid)
            if bm is None:
                continue
            b = self._pending.pop(key)
            hits = set(bm.get_indices_list())
            bits = [j in hits for j in range(len(b.idx))]
            if any(bits):  # all-miss is not a failure: the keys may simply be gone
                self._health.outcome(True, "", now - (b.handed_at or now))
            if kind is BatchKind.LOOKUP:
                ad.submit_unlock(b.okeys)  # native adapters refcount "locks" client-side
                self._batch_done(b, bits)
            elif b.task.state is TaskState.RUNNING:
                self._cpu.submit(self._validate_load, b, bits)
            else:
                self.free_batches([b])

    def expire(self, now: float) -> None:
        """Fail tasks whose adapter call outlived `op_deadline_s`; their batches stay pending
        (quarantined) until the adapter answers or is replaced."""
        for b in list(self._pending.values()):
            t = b.task
            if (
                t.state is not TaskState.RUNNING
                or now - (b.handed_at or now) < self.cfg.op_deadline_s
            ):
                continue
            if not t.lock.acquire(blocking=False):
                continue
            try:
                if t.copying:
                    continue  # a worker is mid-copy into its dst: next round
                expired = self._finish(t, TaskError.DEADLINE)
            finally:
                t.lock.release()
            if expired:
                self.stats.deadline_expired += 1
                self._health.outcome(False, f"{t.op.value} deadline")

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
        self.free_batches([b])
        for _, why in bad:
            st.count_invalid(why)
        if bad:
            self._delete_bad([task.keys[i] for i, _ in bad])
        unread = [task.keys[i] for j, i in enumerate(b.idx) if not bits[j]]
        if unread and self._health.allow() and task.on_done is None:
            self.submit_internal(OpKind.EXISTS, unread, None, self._verified)
        st.get_hits += sum(oks)
        st.get_misses += len(oks) - sum(oks)
        self._batch_done(b, oks)

    def _verified(self, v: Task, error: TaskError | None) -> None:
        """A key the adapter could not load but still lists is unreadable at its size: drop it."""
        present = [k for k, ok in zip(v.keys, v.ok, strict=True) if ok]
        if present and error is None:
            self.stats.unreadable += len(present)
            self._delete_bad(present)

    def _delete_bad(self, keys: list[StorageKey]) -> None:
        self.stats.deleted_bad += len(keys)
        if not self._health.defer_deletes(keys):
            self.submit_internal(OpKind.DELETE, keys, None, lambda t, e: None)

    def _delete(self, adapter: Any, did: int, b: Batch) -> None:  # deleter thread
        try:
            adapter.delete(b.okeys)
            ok = True
        except Exception:
            log.warning("storage delete failed", exc_info=True)
            ok = False
        self._post(lambda: self._deleted(did, b, ok))

    def _deleted(self, did: int, b: Batch, ok: bool) -> None:
        if self._pending.get((BatchKind.DELETE, did)) is b:  # else: its adapter was replaced
            del self._pending[(BatchKind.DELETE, did)]
            self._batch_done(b, [ok] * len(b.idx))

    def _batch_done(self, b: Batch, oks: list[bool]) -> None:
        t = b.task
        if t.state is not TaskState.RUNNING:
            return
        for j, i in enumerate(b.idx):
            t.ok[i] = oks[j]
        t.open_batches -= 1
        if t.open_batches == 0:
            if t.op is OpKind.EXISTS:
                self.stats.exists_hits += sum(t.ok)
                self.stats.exists_misses += len(t.ok) - sum(t.ok)
            self._finish(t, None)

    def _finish(self, t: Task, error: TaskError | None) -> bool:
        """Report `t` (once). False if it was already reported."""
        with t.lock:
            if t.state in _FINISHED:
                return False
            t.state = TaskState.EXPIRED if error is TaskError.DEADLINE else TaskState.DONE
            t.wait_no_copies()  # never hand back the caller's buffers mid-copy
            t.dsts = None
            t.held = t.lent > 0
            if error is not None:
                t.ok = [False] * len(t.ok)
            if t.on_done is None:  # still under t.lock: a release is announced after this
                if t.held:
                    self.lent.hold(t.id)
                with self._cv:
                    self._results[t.id] = TaskResult(
                        t.id, t.op, tuple(t.ok), error, t.held, finished_at=time.monotonic()
                    )
                    self._cv.notify_all()
        with self._live_lock:
            self._live.pop(t.id, None)
        if error is not None:
            self._sweep_queue |= t.op is OpKind.PUT and t.open_batches > 0
        if t.on_done is not None:
            t.on_done(t, error)
        return True

    # ------------------------------------------------------------------ buffers
    def free_batches(self, batches: Sequence[Batch]) -> None:
        """Return staging buffers (and put budget) of batches no adapter holds any more."""
        for b in batches:
            if b.lent and b.staging:
                self.lent.back(b.task)
            elif b.staging:
                self.staging.put(b.staging)
            b.staging = []
            if b.reserved:
                self.budget.release(b.reserved)
                b.reserved = 0

    def release_pending(self) -> None:
        """The adapter is closed (the store is closing): nothing it held is written any more."""
        batches = list(self._pending.values())
        self._pending.clear()
        self.free_batches(batches)

    def detach_batches(self) -> list[Batch]:
        """The adapter is being replaced: fail its tasks, hand over its batches (with their
        buffers) to be freed once it is closed. Queued puts were never given to it: kept."""
        batches = list(self._pending.values())
        self._pending.clear()
        for b in batches:
            if b.task.state is TaskState.RUNNING:
                self._finish(b.task, TaskError.ADAPTER_RECREATED)
        return batches

    def held_for_finished_tasks(self) -> int:
        """Staging buffers still with the current adapter for tasks already reported."""
        return sum(
            len(b.staging) for b in list(self._pending.values()) if b.task.state in _FINISHED
        )

    @property
    def puts_queued(self) -> int:
        return len(self._put_queue)

    def delete_probe_key(self, key: StorageKey, timeout_s: float) -> None:
        """Best effort at close (at interpreter exit the executor refuses new work)."""
        try:
            fut = self._deleter.submit(self._health.adapter.delete, [self._okey(key)])
            fut.result(timeout=timeout_s)
        except Exception:
            pass

    def stop_workers(self) -> None:
        """Refuse new submissions and let the CPU workers finish (the driver has stopped)."""
        self._closed = True
        self._cpu.shutdown(wait=True, cancel_futures=True)

    def fail_unfinished(self) -> None:
        """Report every task not yet finished as CLOSED (last step of closing the store)."""
        self._deleter.shutdown(wait=False, cancel_futures=True)
        with self._live_lock:
            live = list(self._live.values())
        for t in live:
            self._finish(t, TaskError.CLOSED)
