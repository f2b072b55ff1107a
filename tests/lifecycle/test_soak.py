"""The random soak (size: HIMAMBA_SOAK_REQUESTS, 100,000 by default, as in CI)."""

from __future__ import annotations

import os

from .conftest import connector_config
from .faults import LoadFaults, StorageFaults, failing_loads, faulty_storage
from .leaks import assert_no_leaks
from .soak import SoakPlan, ack_faults, run_soak

SOAK_REQUESTS = int(os.environ.get("HIMAMBA_SOAK_REQUESTS", "100000"))


def test_soak_with_faults_ends_clean(make_engine, store_url):
    storage = {
        "prefetch_timeout_base_s": 0.1,
        "op_deadline_s": 0.5,
        "breaker_cooldown_s": 0.2,
    }
    with (
        faulty_storage(
            StorageFaults(fail_rate_lookup=0.01, fail_rate_load=0.02, fail_rate_store=0.01)
        ) as storage_faults,
        failing_loads(LoadFaults(fail_rate=0.01, seed=1)) as load_faults,
    ):
        engine = make_engine(
            describe=False,
            num_gpu_blocks=320,
            max_num_seqs=128,
            max_num_batched_tokens=2048,
            max_model_len=512,
            connector_config=connector_config(store_url, storage=storage),
        )
        late, lost = ack_faults(seed=2)
        engine.output_faults.extend((late, lost))
        result = run_soak(engine, SoakPlan(num_requests=SOAK_REQUESTS), lost_acks=lost)
        assert_no_leaks(engine)
    print(result, engine.hits, storage_faults.counts, load_faults.failed)
    assert result.requests == SOAK_REQUESTS
    assert result.finished + result.aborted + result.errors == SOAK_REQUESTS
    assert result.errors == 0  # recompute policy: a failed load is never a user-visible error
    # Hits really came from every tier.
    assert engine.hits.local_hits > 0
    assert engine.hits.host > 0, engine.hits
    assert engine.hits.storage > 0, engine.hits
    # Every fault kind fired.
    assert load_faults.failed > 0
    assert (
        storage_faults.counts.get("failed_load", 0) + storage_faults.counts.get("failed_store", 0)
        > 0
    )
    assert late.delayed > 0 and lost.dropped > 0
    assert result.aborted > 0
    # Metadata stays bounded by the host capacity, not by the number of requests.
    stats = result.connector_stats
    capacity = stats["host_kv_capacity"] + stats["host_mamba_capacity"]
    assert result.max_tree_nodes <= 8 * capacity + 2048, result
