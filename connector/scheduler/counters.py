"""The scheduler half's counters (see ``himamba.connector.counters``): hits and stores, and the
storage planner's probes and fetches, which report with them."""

from __future__ import annotations

from dataclasses import dataclass

from himamba.connector.counters import Counters


@dataclass
class SchedulerCounters(Counters):
    steps: int = 0
    lookups: int = 0
    lookups_missed: int = 0  # lookups that promised nothing
    loads: int = 0
    loads_failed: int = 0
    hit_tokens: int = 0
    hit_tokens_storage: int = 0  # of hit_tokens, those a storage fetch brought in
    kv_blocks_stored: int = 0
    mamba_states_stored: int = 0
    mamba_states_skipped: int = 0
    mamba_states_replaced: int = 0
    mamba_incomplete_handoffs: int = 0
    tails_stored: int = 0  # finished requests' partial last blocks (with their states) kept
    tails_unnamed: int = 0  # not kept: a forward in flight took a token vLLM had not seen yet
    tails_overwritten: int = 0  # given up: Model Runner V2 rewrote their blocks before the copy
    tail_hits: int = 0  # hits that end inside a block, at a kept tail
    storage_tails_seen: int = 0  # tails a storage probe found past a request's stored blocks
    resets: int = 0
    storage_writes_planned: int = 0
    storage_probes: int = 0
    storage_probes_head_missed: int = 0  # settled by block 0's KV object alone: no hit
    storage_blocks_seen: int = 0
    storage_missing_masked: int = 0
    storage_fetches: int = 0
    storage_fetched: int = 0
    storage_fetch_failed: int = 0
    storage_fetch_no_space: int = 0
    storage_fetch_shortened: int = 0
    storage_fetch_below_threshold: int = 0  # a storage hit that would add too little
    storage_fetches_abandoned: int = 0
    # A waiting request's deadline passed while it was in this phase.
    storage_probing_timeouts: int = 0
    storage_answered_timeouts: int = 0
    storage_fetching_timeouts: int = 0


@dataclass
class LedgerCounters(Counters):
    fetches_done: int = 0
    fetches_abandoned: int = 0
    fetches_acked_across_steps: int = 0
    stale_acks: int = 0
    duplicate_acks: int = 0
