"""himamba.tiers."""
