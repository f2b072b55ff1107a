"""The storage generation: epoch, planner id and fetch ids, owned by the scheduler half.

It outlives every ``StoragePlanner``: a reset while storage is detached still moves the epoch,
an attach after it writes and probes under the new one, and fetch ids keep counting across
planners, so nothing a closed planner sent can be mistaken for what a new one sends.
"""

from __future__ import annotations

import itertools
import logging
import uuid

from himamba.connector.protocol import Generation

logger = logging.getLogger(__name__)


class StorageGenerations:
    def __init__(self) -> None:
        # "" = since start-up: a restarted process with the same weights reads what the last
        # one wrote (the namespace already carries the weights' identity).
        self.current = Generation()
        self._planners = itertools.count(1)
        self._fetch_ids = itertools.count(1)

    @property
    def epoch(self) -> str:
        return self.current.epoch

    def new_epoch(self) -> None:
        """New weights (or an explicit reset): nothing stored so far may be served any more."""
        self.current = Generation("r" + uuid.uuid4().hex[:16], self.current.planner)
        logger.info("himamba: storage epoch reset; older objects are unreachable")

    def new_planner(self) -> int:
        """A store was attached: its planner's id (acks of any other planner are stale)."""
        planner = next(self._planners)
        self.current = Generation(self.current.epoch, planner)
        return planner

    def detached(self) -> None:
        self.current = Generation(self.current.epoch, 0)

    def next_fetch_id(self) -> int:
        return next(self._fetch_ids)
