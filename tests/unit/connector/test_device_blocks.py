"""Direct reads of vLLM's block tables fall back to the public call when vLLM's internals are
not as expected. The direct path itself is checked against a real vLLM scheduler in
``tests/lifecycle/test_tier_hits.py``; here the faults a real vLLM cannot produce on demand
(a moved attribute, a table that disagrees) are injected."""

from __future__ import annotations

from types import SimpleNamespace

from himamba.connector.scheduler.device_blocks import CHECKED_READS, DeviceBlockIds


class _Manager:
    """Shaped like vLLM's KV cache manager: ``coordinator.single_type_managers[g]
    .req_to_blocks`` behind ``get_block_ids``."""

    def __init__(self, tables: dict[str, list[list[int]]]) -> None:
        self.tables = tables
        managers = []
        for g in range(3):
            blocks = {r: [SimpleNamespace(block_id=b) for b in t[g]] for r, t in tables.items()}
            managers.append(SimpleNamespace(req_to_blocks=blocks))
        self.coordinator = SimpleNamespace(single_type_managers=managers)

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return tuple(list(t) for t in self.tables[req_id])


def _state(manager: object, req_ids: set[str]) -> SimpleNamespace:
    def get_block_ids(req_id: str):
        return manager.get_block_ids(req_id) if req_id in req_ids else None

    return SimpleNamespace(
        req_ids=req_ids, resolve_block_ids=manager.get_block_ids, get_block_ids=get_block_ids
    )


TABLES = {"a": [[5, 6, 7, 8], [90, 91], [11, 12, 13, 14]]}


def test_direct_reads_return_the_public_rows_of_the_attention_groups():
    manager = _Manager(TABLES)
    dev = DeviceBlockIds([0, 2])
    state = _state(manager, {"a"})
    for _ in range(CHECKED_READS + 2):
        assert dev.rows(state, "a", 1, 3) == [[6, 7], [12, 13]]
    assert dev.rows(state, "a", 2, 9) == [[7, 8], [13, 14]]  # shorter where vLLM has fewer
    assert dev.rows(state, "b", 0, 2) is None  # not offered this step
    assert dev.direct


def test_a_table_that_disagrees_switches_the_direct_path_off(caplog):
    manager = _Manager(TABLES)
    manager.coordinator.single_type_managers[2].req_to_blocks["a"][1].block_id = 99
    dev = DeviceBlockIds([0, 2])
    state = _state(manager, {"a"})
    with caplog.at_level("WARNING"):
        assert dev.rows(state, "a", 0, 4) == [[5, 6, 7, 8], [11, 12, 13, 14]]
    assert not dev.direct
    assert "get_block_ids" in caplog.text
    assert dev.rows(state, "a", 0, 4) == [[5, 6, 7, 8], [11, 12, 13, 14]]


def test_missing_internals_fall_back_to_the_public_call():
    manager = _Manager(TABLES)
    state = _state(manager, {"a"})
    state.resolve_block_ids = lambda req_id: manager.get_block_ids(req_id)  # no __self__
    dev = DeviceBlockIds([0, 2])
    assert dev.rows(state, "a", 0, 2) == [[5, 6], [11, 12]]
    assert not dev.direct
