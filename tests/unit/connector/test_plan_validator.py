"""The plan validator: a host slot written into by one part of a step plan may have no other
role in it, since the worker runs the parts at different hooks."""

from __future__ import annotations

import pytest

from himamba.connector.protocol import (
    FetchItem,
    FetchOrder,
    LoadJob,
    ObjectKind,
    PlanConflict,
    SlotRole,
    StepPlan,
    StorageWrite,
    check_plan,
    plan_conflicts,
)

H = b"h" * 16


def load(kv: tuple[int, ...], mamba: int) -> LoadJob:
    return LoadJob("r", kv, ((1,) * len(kv),), mamba, (1,))


def test_a_safe_plan_passes_and_two_reads_of_one_slot_are_safe() -> None:
    plan = StepPlan(loads=[load((1, 2), 0)])
    plan.kv_stores.add(3, [7], H)
    plan.storage_writes.append(StorageWrite(ObjectKind.KV, 1, H))  # popular block: read twice
    plan.fetches.append(FetchOrder(1, (FetchItem(ObjectKind.MAMBA, H, 1),)))  # other kind
    assert plan_conflicts(plan) == []
    check_plan(plan)


@pytest.mark.parametrize(
    "second",
    [SlotRole.FETCH_TARGET, SlotRole.WRITE_SOURCE, SlotRole.LOAD_SOURCE, SlotRole.STORE_TARGET],
)
def test_a_store_target_with_any_second_role_is_rejected(second: SlotRole) -> None:
    plan = StepPlan()
    plan.kv_stores.add(5, [7], H)
    if second is SlotRole.FETCH_TARGET:
        plan.fetches.append(FetchOrder(1, (FetchItem(ObjectKind.KV, H, 5),)))
    elif second is SlotRole.WRITE_SOURCE:
        plan.storage_writes.append(StorageWrite(ObjectKind.KV, 5, H))
    elif second is SlotRole.LOAD_SOURCE:
        plan.loads.append(load((5,), 0))
    else:
        plan.kv_stores.add(5, [8], H)
    assert plan_conflicts(plan) == [(ObjectKind.KV, 5, (SlotRole.STORE_TARGET, second))]
    with pytest.raises(PlanConflict, match="KV slot 5"):
        check_plan(plan)


def test_a_fetch_into_a_write_back_source_is_rejected_for_mamba_slots_too() -> None:
    plan = StepPlan(storage_writes=[StorageWrite(ObjectKind.MAMBA, 2, H)])
    plan.fetches.append(FetchOrder(4, (FetchItem(ObjectKind.MAMBA, H, 2),)))
    assert plan_conflicts(plan) == [
        (ObjectKind.MAMBA, 2, (SlotRole.FETCH_TARGET, SlotRole.WRITE_SOURCE))
    ]


def test_a_doomed_load_reads_nothing() -> None:
    plan = StepPlan(loads=[LoadJob("r", (5,), ((1,),), 0, (1,), doomed="trimmed")])
    plan.kv_stores.add(5, [7], H)
    assert plan_conflicts(plan) == []
