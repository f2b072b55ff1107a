"""himamba.connector."""
