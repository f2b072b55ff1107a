"""The random soak under storage churn, once per write policy, and with partial tails (sync, async).

Size: HIMAMBA_SOAK_REQUESTS (100,000 by default, as in CI), split evenly across the variants.
Each variant runs vLLM's real scheduler over a CPU tier of a few dozen KV slots and a handful
of Mamba slots, an LMCache ``file://`` store, every fault (aborts, failed loads, failed storage
ops, late and lost acknowledgements) and random control between steps (attach, detach, switch
store, resets with and without the connector, ``drop_host_tier``, weight updates). Three variants
send conversations (a finished or aborted request's prompt and answer plus a new message), two
with ``partial_tail_hits`` (hits inside a block, through a kept tail of the CPU tier or of
storage; tail objects are audited on the rows a reader uses), one of those under vLLM's
AsyncScheduler, two steps in flight as on a GPU. It must end
with no error, nothing held, no step plan that gives a host slot two roles, and every object
left in every store directory holding exactly the bytes of the prefix its key names.
"""

from __future__ import annotations

import os

import pytest

from .churn import ACTIONS
from .churn_soak import (
    CHURN_KV_SLOTS,
    CHURN_MAMBA_SLOTS,
    ChurnReport,
    ChurnVariant,
    run_churn_soak,
)

SOAK_REQUESTS = int(os.environ.get("HIMAMBA_SOAK_REQUESTS", "100000"))
SOAK_SEED = int(os.environ.get("HIMAMBA_SOAK_SEED", "0"))

VARIANTS = (
    ChurnVariant("write_through"),
    ChurnVariant("write_through_selective"),
    # Conversations: 30% of requests continue a finished one (its prompt and answer plus a new
    # message); without partial tails they hit at block boundaries, with them inside a block.
    ChurnVariant("write_back", conversation_share=0.3),
    ChurnVariant("write_through", partial_tails=True, conversation_share=0.3),
    # A GPU engine's defaults: vLLM's AsyncScheduler (a step is scheduled before the previous
    # one's output is in; an aborted request's tail covers the forward still in flight) and
    # Model Runner V2's call order (new blocks zeroed before the connector's first hook).
    ChurnVariant(
        "write_back",
        async_scheduling=True,
        model_runner_v2=True,
        partial_tails=True,
        conversation_share=0.3,
    ),
)


def _share(i: int) -> int:
    """Variant i's part of SOAK_REQUESTS (the parts add up to it exactly)."""
    n = len(VARIANTS)
    return SOAK_REQUESTS // n + (i < SOAK_REQUESTS % n)


@pytest.mark.parametrize("index", range(len(VARIANTS)), ids=[v.name for v in VARIANTS])
def test_soak_under_churn_ends_clean_and_exact(make_engine, tmp_path, index):
    variant, n = VARIANTS[index], _share(index)
    report = ChurnReport(variant.name, n, SOAK_SEED)
    try:
        run_churn_soak(make_engine, tmp_path, variant, n, seed=SOAK_SEED, report=report)
    finally:
        print(report.line())
    result, hits, churn, plans, storage = (
        report.result,
        report.hits,
        report.churn,
        report.plans,
        report.storage,
    )
    assert report.capacities == (CHURN_KV_SLOTS, CHURN_MAMBA_SLOTS)
    # Nothing held once idle (vLLM, both connector roles; see leaks.assert_no_leaks).
    assert not report.leaks, "leaked after the engine went idle:\n  " + "\n  ".join(report.leaks)
    assert result.requests == n
    assert result.finished + result.aborted + result.errors == n
    assert result.errors == 0  # recompute policy: a failed load is never a user-visible error
    # The runner checked what steps read (every attention row and Mamba state of every step),
    # in particular every request that started from a cached prefix of any tier.
    assert report.rows_checked > 0 and report.states_checked > 0
    assert report.from_cache_unchecked == 0
    # No plan gave one host slot two roles.
    assert plans.conflict_entries == 0, plans.summary()
    # Every object left in storage holds exactly its prefix's bytes.
    assert storage.objects > 0
    assert not storage.problems(), "\n".join(storage.problems())
    # Hits came from every tier; every fault and every control action happened.
    assert hits.local_hits > 0 and hits.host > 0 and hits.storage > 0, hits
    faults = report.faults
    assert faults["failed_loads"] > 0 and faults["late_acks"] > 0 and faults["lost_acks"] > 0
    assert sum(v for k, v in faults["storage"].items() if k.startswith("failed_")) > 0
    assert result.aborted > 0
    if n >= 20_000:
        assert set(churn.actions) == set(ACTIONS), churn.actions
        assert churn.weight_updates > 0 and len(churn.urls_used) > 1
    # Next turns were sent and, with partial tails, hit inside a block from both tiers.
    tails = report.tails()
    assert (tails["next_turns"] > 0) == (variant.conversation_share > 0), tails
    if variant.partial_tails:
        assert tails["tail_hits"] > 0 and tails["storage_tails_seen"] > 0, tails
        # Under Model Runner V2 too, tails are copied before vLLM rewrites their blocks (the
        # step-start hook), so none is given up.
        assert tails["tails_overwritten"] == 0, tails
    # Metadata stays bounded by the host capacity, not by the number of requests.
    capacity = sum(report.capacities)
    assert result.max_tree_nodes <= 8 * capacity + 2048, result
