"""What operators and routers see: interval stats, Prometheus metrics and KV-cache events."""
