#!/usr/bin/env bash
# GPU checks of the copy engine (issue 9), in one go, within 10 minutes on a GPU machine:
#   bash benchmarks/gpu_check.sh [OUTDIR]        # OUTDIR defaults to $OUT, else ./gpu_check_out
# Uses the machine's own Python with a CUDA torch (no network needed): our package is put on
# the path through a namespace shim (no pip), then it runs the `gpu` tests and the transfer
# benchmark (random and consecutive ids) on the device, writing everything under OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is False)" | tee "$OUTDIR/env.txt"
    exit 2
fi
$PY - <<'PY' | tee "$OUTDIR/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
try:
    from vllm import _custom_ops as ops
    print("vllm swap_blocks_batch:", hasattr(ops, "swap_blocks_batch"))
except Exception as exc:  # no vLLM: the engine falls back to torch copies
    print("vllm not importable:", exc)
PY
SHIM=$(mktemp -d)
mkdir -p "$SHIM/himamba"
for pkg in connector mamba_state tiers; do ln -s "$PWD/$pkg" "$SHIM/himamba/$pkg"; done
export PYTHONPATH="$SHIM:$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import pytest" 2>/dev/null || $PY -m pip install -q pytest >/dev/null 2>&1
rc=0
timeout 200 $PY -m pytest -q -p no:cacheprovider --noconftest -rs tests/unit/tiers/test_transfer_cuda.py tests/unit/tiers/test_cuda_staging.py tests/unit/tiers/test_transfer_engine.py tests/unit/tiers/test_transfer.py \
    2>&1 | tee "$OUTDIR/gpu_tests.txt" || rc=1
# The batched DMA (vLLM's op, else the driver's through ctypes) as the connector runs it
# (scattered rows staged into whole slots), then the plan's direct pointer lists and the torch
# slice-copy fallback on random ids, for comparison.
for ids in random consecutive; do
    timeout 100 $PY -m benchmarks.bench_transfer --device cuda --quick --ids "$ids" \
        2>&1 | tee "$OUTDIR/bench_transfer_$ids.jsonl" || rc=1
done
for op in direct torch; do
    timeout 100 $PY -m benchmarks.bench_transfer --device cuda --quick --ids random --op "$op" \
        2>&1 | tee "$OUTDIR/bench_transfer_random_$op.jsonl" || rc=1
done
# The CPU side of a staged job on this machine's CPU (planning, layout, launches' Python).
timeout 60 $PY -m benchmarks.bench_staging_issue 2>&1 | tee "$OUTDIR/bench_staging_issue.jsonl" || rc=1
echo "gpu_check: exit $rc" | tee -a "$OUTDIR/env.txt"
exit $rc
