"""himamba.mamba_state."""
