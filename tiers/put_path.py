"""The write side of the task pipeline: a put from the caller's buffers to the adapter.

    caller thread: copy each payload into a staging buffer (after header room), budgeted
    CPU worker:    seal the header + checksum
    driver:        queue; hand to the adapter at most `adapter_put_depth` batches at a time

The one copy happens at submission so the caller may reuse its memory at once; the write
budget bounds how much that can hold while storage is slow. The queue sits in front of the
adapter so a burst is not stuck inside it: the op deadline starts at the hand-off and times
the backend, not the queue, and gets are not stuck behind the burst.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .object_format import HEADER_SIZE, StorageKey, key_digest, seal_object, stored_size
from .pipeline_parts import PipelineParts
from .staging import as_segments, by_size, copy_segments
from .storage_config import StorageConfig
from .storage_records import Batch, BatchKind, OpKind, Task, TaskError
from .task_book import OnDone

log = logging.getLogger(__name__)


class PutPath:
    """Staging, sealing, queueing and completion of puts."""

    def __init__(self, cfg: StorageConfig, parts: PipelineParts) -> None:
        self.cfg, self.ns, self._algo = cfg, parts.namespace, parts.algo
        self._ns_digest = parts.namespace.digest()
        self._okey, self._wrap = parts.shapes.object_key, parts.shapes.wrap
        self._book, self._calls, self._health = parts.book, parts.calls, parts.health
        self.stats, self._cpu, self._post = parts.stats, parts.cpu, parts.post
        self._queue: deque[Batch] = deque()  # sealed, waiting for an adapter slot (driver)
        self._sweep = False  # a put failed as a whole: drop its queued batches

    @property
    def queued(self) -> int:
        return len(self._queue)

    def sweep_later(self) -> None:
        """A put failed with batches still open (any thread): the driver drops them."""
        self._sweep = True

    # ------------------------------------------------------------------ caller thread
    def submit(self, keys: Sequence[StorageKey], payloads: Sequence[Any]) -> int:
        """Copy payloads into store memory now; refuse the whole put with BACKPRESSURE if it
        does not fit the write buffer."""
        task_id, stage = self.submit_later(keys, payloads)
        if stage is not None:
            stage()
        return task_id

    def submit_later(
        self, keys: Sequence[StorageKey], payloads: Sequence[Any]
    ) -> tuple[int, Callable[[], None] | None]:
        """Reserve the write buffer for a put now and return the copy into it as a callable,
        for the caller to run on a thread of its own (its copy thread), so the copy overlaps
        the caller's work instead of blocking it. The payload memory must stay unchanged
        until the callable ran. ``None`` instead of a callable: the put already failed (its
        result says why), there is nothing to copy."""
        segs = [as_segments(p) for p in payloads]
        if len(segs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(segs)} payloads")
        task = self._book.new(OpKind.PUT, list(keys), None)
        if not keys:
            return self._book.finish_now(task, None), None
        if not self._health.allow():
            return self._book.finish_now(task, TaskError.BREAKER_OPEN), None
        sizes = [stored_size(sum(s.nbytes for s in seg)) for seg in segs]
        if not self._calls.budget.try_reserve(sum(sizes)):
            self.stats.puts_skipped += len(keys)
            return self._book.finish_now(task, TaskError.BACKPRESSURE), None
        try:
            batches = self._allocate(task, sizes)
        except BaseException:  # e.g. MemoryError: give the budget back, report, re-raise
            self._calls.budget.release(sum(sizes))
            self._book.finish(task, TaskError.BACKPRESSURE)
            raise

        def stage() -> None:
            self._copy(batches, segs)
            self._post(lambda: self._start(task, batches))

        return task.id, stage

    def _stage(self, task: Task, segs: list[list[np.ndarray]], sizes: list[int]) -> list[Batch]:
        """The one copy of a put: caller memory -> staging buffer, after the header space."""
        batches = self._allocate(task, sizes)
        self._copy(batches, segs)
        return batches

    def _allocate(self, task: Task, sizes: list[int]) -> list[Batch]:
        batches = []
        for idx in by_size(sizes):
            staging = [self._calls.staging.get(sizes[i]) for i in idx]
            okeys = [self._okey(task.keys[i]) for i in idx]
            batches.append(
                Batch(task, BatchKind.STORE, idx, okeys, staging, reserved=sizes[idx[0]] * len(idx))
            )
        task.open_batches = len(batches)
        return batches

    @staticmethod
    def _copy(batches: list[Batch], segs: list[list[np.ndarray]]) -> None:
        for b in batches:
            for i, buf in zip(b.idx, b.staging, strict=True):
                copy_segments(buf[HEADER_SIZE:], segs[i])

    # ------------------------------------------------------------------ driver thread
    def put_internal(self, keys: list[StorageKey], bufs: list[np.ndarray], on_done: OnDone) -> None:
        """A health probe's put: sealed here and handed over at once, past breaker and queue."""
        task = self._book.new_internal(OpKind.PUT, keys, None, on_done)
        if task is None:
            return
        sizes = [stored_size(b.nbytes) for b in bufs]
        self._calls.budget.try_reserve(sum(sizes), force=True)
        for b in self._stage(task, [[b] for b in bufs], sizes):
            self._seal(b)
            self._hand(b)

    def _start(self, task: Task, batches: list[Batch]) -> None:
        if task.finished or not self._health.allow():
            self._calls.free(batches)
            self._book.finish(task, TaskError.BREAKER_OPEN)
            return
        try:
            self._cpu.submit(self._seal_all, task, batches)
        except RuntimeError:  # the workers were shut down: the store is closing
            self._calls.free(batches)
            self._book.finish(task, TaskError.CLOSED)

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
        if task.finished:
            self._calls.free(batches)
        else:
            self._queue.extend(batches)

    def dispatch(self) -> None:
        """Hand queued puts to the adapter while it has room; fail them all if it may not be used."""
        if self._sweep:
            self._sweep = False
            dead = [b for b in self._queue if b.task.finished]
            if dead:
                self._queue = deque(b for b in self._queue if not b.task.finished)
                self._calls.free(dead)
        if not self._queue:
            return
        if not self._health.allow():
            queued = self.drop_queue()
            for b in queued:
                self._book.finish(b.task, TaskError.BREAKER_OPEN)
            return
        at_adapter = self._calls.count(BatchKind.STORE)
        while self._queue and at_adapter < self.cfg.adapter_put_depth:
            b = self._queue.popleft()
            if b.task.finished:
                self._calls.free([b])
                continue
            self._hand(b)
            at_adapter += 1

    def drop_queue(self) -> list[Batch]:
        """Free every queued batch (no adapter has seen them); returns them."""
        queued, self._queue = list(self._queue), deque()
        self._calls.free(queued)
        return queued

    def _hand(self, b: Batch) -> None:
        try:
            tid = self._health.adapter.submit_store_task(
                b.okeys, [self._wrap(s) for s in b.staging]
            )
        except Exception:
            log.warning("storage put submit failed", exc_info=True)
            self._calls.free([b])
            self._health.outcome(False, "put submit failed")
            self._book.finish(b.task, TaskError.ADAPTER)
            return
        self._calls.add(BatchKind.STORE, tid, b)

    def collect(self, adapter: Any, now: float) -> None:
        """Take the adapter's finished store calls."""
        for tid, res in adapter.pop_completed_store_tasks().items():
            b = self._calls.pop(BatchKind.STORE, tid)
            if b is None:
                continue
            ok, n, nbytes = res.is_successful(), len(b.idx), sum(s.nbytes for s in b.staging)
            self._calls.free([b])
            self._health.outcome(ok, "store failed", now - (b.handed_at or now))
            if not ok:
                self._health.op_failed("store")
            self.stats.put_objects += n if ok else 0
            self.stats.put_failed += 0 if ok else n
            self.stats.bytes_written += nbytes if ok else 0
            self._book.batch_done(b, [ok] * n)
