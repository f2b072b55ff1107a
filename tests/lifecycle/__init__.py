"""Scheduler-level lifecycle suite: vLLM's real Scheduler / AsyncScheduler with a hybrid
(full attention + Mamba align) KV cache, the real HiMambaConnector in both roles over CPU
tensors, a real LMCache file store, and stand-in model runners that check every byte a step
reads (see runner.py). Faults are injected only where no real part produces them on demand
(faults.py). Every test ends with ``assert_no_leaks``.

Run: ``.venv/bin/python -m pytest -q tests/lifecycle`` (HIMAMBA_SOAK_REQUESTS sets the soak
size, 100,000 by default, split across its write-policy variants; HIMAMBA_SOAK_SEED its seed).
Against vLLM 0.33: ``make test-vllm033``.
"""
