"""himamba.mamba_state: SSM state layout, snapshot/restore between device pages and host slots."""
