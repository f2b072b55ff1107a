"""himamba.tiers: pinned-CPU slot pool, block transfers, LMCache storage."""
