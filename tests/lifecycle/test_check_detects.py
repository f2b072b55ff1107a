"""The suite's CHECK must be able to fail: one flipped bit where a hit reads from is caught."""

from __future__ import annotations

import numpy as np
import pytest
from vllm.v1.request import RequestStatus

from .conftest import connector_config
from .prefix_bytes import HEADER, HEADER_BYTES, CacheMismatch
from .workload import prompt_of


def _host_slot_row(pool, max_pos: int) -> np.ndarray:
    """Layer 0's bytes of a used host slot whose content starts before ``max_pos``."""
    rows = pool.np_rows[0]
    for slot in range(rows.shape[0]):
        row = rows[slot]
        if row.any():
            pos = int(np.frombuffer(row[:HEADER_BYTES].tobytes(), dtype=HEADER)[0]["pos"])
            if pos < max_pos:
                return row
    raise AssertionError("no used host slot below the hit boundary")


def _served_twice(make_engine):
    engine = make_engine(connector_config=connector_config())
    prompt = prompt_of(7, 80)
    engine.add_request("a", prompt, max_tokens=3)
    engine.run_until_idle()
    assert engine.scheduler.reset_prefix_cache()
    return engine, prompt


@pytest.mark.parametrize("where", ["host_kv_slot", "host_mamba_slot"])
def test_flipped_bit_in_host_slot_is_caught(make_engine, where):
    engine, prompt = _served_twice(make_engine)
    worker = engine.runners[0].connector.worker
    if where == "host_kv_slot":
        # A trailing byte of a token row in the middle of the block: not even a header.
        row = _host_slot_row(worker.kv_pool, max_pos=64)
        row[7 * engine.model.attn_row_bytes + HEADER_BYTES + 3] ^= 0x10
    else:
        row = _host_slot_row(worker.mamba.pool, max_pos=65)
        row[HEADER_BYTES + 11] ^= 0x01
    engine.add_request("b", prompt, max_tokens=3)
    with pytest.raises(CacheMismatch, match="'b'"):
        engine.run_until_idle()


def test_flipped_bit_in_loaded_block_is_caught(make_engine):
    engine, prompt = _served_twice(make_engine)
    engine.add_request("b", prompt, max_tokens=3)
    # The step that admits b as WAITING_FOR_REMOTE_KVS also runs its load on the worker;
    # b's first forward is in a later step.
    engine.run_until(lambda: engine.status("b") == RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert engine.runners[0].requests.get("b") is None
    attn_group = engine.runners[0].attn_groups[0]
    block = engine.scheduler.kv_cache_manager.get_block_ids("b")[attn_group][2]
    layer = engine.runners[0].layers_by_group[attn_group][1]
    layer.pages[block, 5 * engine.model.attn_row_bytes + 1] ^= 0x04
    with pytest.raises(CacheMismatch, match=r"'b'.*block index 2"):
        engine.run_until_idle()
