"""The store's driver: the one thread that talks to the adapter, and what happens once it stops.

Adapter calls, completions and deadlines all run on this thread, so the pipeline's adapter-side
state needs no locks; other threads hand it work with `post`. Whatever is posted runs exactly
once, even across a close: while the thread runs, the thread runs it; when the thread leaves
its loop it runs what is still queued, and from then on `post` runs the callable on the posting
thread, one at a time (under `exclusive`). A completion that arrives while the store closes or
after (a CPU worker's validation, an old adapter that finally closed) must still free the
buffers it holds: dropping it would lose the release of views a caller lent, for good.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import threading
import time
from collections.abc import Callable, Iterator

from .thread_priority import lower_current_thread

log = logging.getLogger(__name__)
_TICK_S = 0.05  # wake-up without events: deadlines and probes need a clock
# Posted work runs in slices of this long, each followed by a step (completions, deadlines).
# A burst of submissions (an engine receiving hundreds of prompts, each probed) otherwise
# hands every probe to the adapter before collecting the first answer: in a burst of 256
# probes of 64 keys on the file store, the first answer came back with the last, 100-140 ms
# after the burst (bench_probe --file).
_POSTED_SLICE_S = 0.002


class Driver:
    """Runs posted callables, then `step`, each time an fd from `fds()` fires (or every tick),
    and after every `_POSTED_SLICE_S` of posted work."""

    def __init__(
        self, step: Callable[[], None], fds: Callable[[], list[int]], nice: int = 0
    ) -> None:
        self._step, self._fds, self._nice = step, fds, nice
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._pipe_lock = threading.Lock()  # no wake-up write into a closed (reused) fd
        self._pipe_open = True
        # A wake-up byte is in the pipe and the thread has not started its round yet: later
        # posts need not write another. Each write is a system call that lets go of the GIL,
        # and a poster that lets go and takes it back every millisecond (an arrival burst
        # probing each prompt) starves this thread: CPython's waiter only forces a switch
        # after 5 ms with no hand-over at all, so it waited out whole bursts (250 ms for 256
        # prompts in bench_scheduler_step) while the probes it should answer piled up.
        self._wake_pending = False
        self._stop = threading.Event()
        self._lock = threading.RLock()  # held by whoever runs posted work off the thread
        self._stopped = False  # the thread left its loop: `post` runs work inline
        self._thread = threading.Thread(target=self._run, name="himamba-l3-driver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the driver thread, or right here once it has stopped."""
        self._inbox.put(fn)
        # `_stopped` is set before the thread's last drain: read False here, that drain
        # comes after the put above and takes `fn`; read True, nobody else will.
        if self._stopped:
            with self._lock:
                self._run_posted()
        else:
            self._wake()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold off inline runs of posted work (for the closing thread's own steps)."""
        with self._lock:
            yield

    def stop(self, timeout_s: float) -> bool:
        """Stop the loop; False if the thread is still inside a step after `timeout_s` (it
        stops after that step, and posted work then runs inline)."""
        self._stop.set()
        if not self._thread.is_alive() and self._thread.ident is None:  # never started
            self._leave()
            return True
        self._wake()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def close(self) -> None:
        """Release the wake-up pipe (after `stop`)."""
        if self._thread.is_alive():
            return  # still in a step and selecting on the pipe: leave it to the process
        with self._pipe_lock:
            if self._pipe_open:
                self._pipe_open = False
                os.close(self._wake_r)
                os.close(self._wake_w)

    # ------------------------------------------------------------------ internals
    def _wake(self) -> None:
        if self._wake_pending:
            return  # the thread has not begun its round: it takes this post in it
        with self._pipe_lock:
            if not self._pipe_open:
                return
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass  # pipe full: a wake-up is pending anyway

    def _run_posted(self, until: float | None = None) -> bool:
        """Run posted work in order, until the inbox is empty or, given ``until`` (monotonic),
        that time has passed; True if some is left."""
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return False
            try:
                fn()
            except Exception:
                log.exception("storage driver step failed")
            if until is not None and time.monotonic() >= until:
                return True

    def _leave(self) -> None:
        with self._lock:
            self._stopped = True
            self._run_posted()

    def _run(self) -> None:
        lower_current_thread(self._nice)  # background work (tiers.thread_priority)
        more = False  # posted work left over from the last round: poll, do not wait
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select(
                    [self._wake_r, *self._fds()], [], [], 0 if more else _TICK_S
                )
            except (OSError, ValueError):
                ready = []
            # Before the inbox is read: a post from here on is either taken by this round
            # or writes a new wake-up byte.
            self._wake_pending = False
            for fd in ready:
                try:
                    os.read(fd, 4096 if fd == self._wake_r else 8)
                except OSError:
                    pass
            more = self._run_posted(time.monotonic() + _POSTED_SLICE_S)
            try:
                self._step()
            except Exception:
                log.exception("storage driver poll failed")
        self._leave()
