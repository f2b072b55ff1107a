"""Counters are per-owner dataclasses: a misspelt counter name fails where it is used."""

from __future__ import annotations

import pytest

from himamba.connector.scheduler.counters import SchedulerCounters
from himamba.connector.tree.counters import TreeCounters


def test_a_misspelt_counter_raises_instead_of_reading_zero() -> None:
    c = SchedulerCounters()
    c.lookups += 2
    assert c["lookups"] == 2 and c.get("lookups") == 2
    with pytest.raises(AttributeError, match="lookupz"):
        c.get("lookupz", 0)
    with pytest.raises(AttributeError, match="hitz"):
        TreeCounters()["hitz"] += 1
    assert c.as_dict()["lookups"] == 2 and {**c}["lookups"] == 2
