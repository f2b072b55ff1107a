"""Host-side ordering of copies that complete late, as on a GPU (no GPU needed).

On a GPU the copy engine overlaps compute: a step's device -> host stores may still be in
flight at the next step, and the fence only hands on the ones that completed. Two stores into
one host slot can then complete together, and the worker must hand the first to storage (under
its own key) before the second overwrites the slot. This engine runs every copy at once, so the
device side is always ordered, but reports completion only a few polls later, as an event
would: what it exposes is exactly the host side. The churn soak then reads every object left in
storage back against the prefix oracle: one written under another block's key fails it."""

from __future__ import annotations

from typing import Any

import pytest

from himamba.tiers.transfer_engine import HostCopyEngine, JobResult

from .churn_soak import ChurnReport, ChurnVariant, run_churn_soak
from .faults import replaced_everywhere

REPORT_AFTER_POLLS = 3


class LateReportingEngine(HostCopyEngine):
    """Copies run on submission; ``collect`` reports a job only after a few polls."""

    overlaps_compute = True

    def __init__(self) -> None:
        super().__init__("himamba-late-copy")
        self._age: dict[int, int] = {}

    def submit(self, plans: Any) -> int:
        job = super().submit(plans)
        super().wait([job])  # the device side: done before anything later reads the block
        self._age[job] = 0
        return job

    def collect(self, job_ids: Any) -> list[JobResult]:
        ready = []
        for j in job_ids:
            age = self._age.get(j)
            if age is None or age >= REPORT_AFTER_POLLS:
                ready.append(j)
            else:
                self._age[j] = age + 1
        out = super().collect(ready)
        for r in out:
            self._age.pop(r.job_id, None)
        return out

    def wait(self, job_ids: Any = None) -> None:
        ids = list(self._age) if job_ids is None else list(job_ids)
        for j in ids:
            if j in self._age:
                self._age[j] = REPORT_AFTER_POLLS
        super().wait(ids)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_stores_completing_late_leave_every_stored_object_exact(make_engine, tmp_path, policy):
    variant = ChurnVariant(policy)
    report = ChurnReport(variant.name, 4000, 3)
    with replaced_everywhere(
        "himamba.tiers.transfer_engine", "make_copy_engine", lambda on_cuda: LateReportingEngine()
    ):
        run_churn_soak(make_engine, tmp_path, variant, 4000, seed=3, report=report, faults=False)
    print(report.line())
    assert not report.leaks, report.leaks
    assert report.result.errors == 0
    assert report.plans.conflict_entries == 0, report.plans.summary()
    assert report.storage.objects > 0
    assert not report.storage.problems(), "\n".join(report.storage.problems())
