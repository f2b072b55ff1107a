"""Run the storage tier's threads at a lower CPU priority than the engine.

Storage work (copies into staging, checksums, the adapter's file or socket I/O) is background
work: write-through only has to keep up on average, and the write buffer bounds its backlog.
On a busy host it must not take CPU from vLLM's engine loop and compute threads, or every
request pays for the writes of the previous ones. Linux lets one thread lower its own priority
(``setpriority`` on its thread id); elsewhere this does nothing. Only threads this package
starts are lowered (the store's driver and copy workers): an adapter's own I/O threads cannot
be told apart from threads other code starts meanwhile, and lowering one of vLLM's would be
far worse than leaving the adapter's alone.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def lower_thread(tid: int, nice: int) -> None:
    """Raise thread ``tid``'s niceness to ``nice`` (never lowers it; errors are ignored)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        pass


def lower_current_thread(nice: int) -> None:
    lower_thread(threading.get_native_id(), nice)


def initializer(nice: int) -> Callable[[], None]:
    """For ``ThreadPoolExecutor(initializer=...)``: each worker lowers itself when it starts."""
    return lambda: lower_current_thread(nice)
