#!/usr/bin/env bash
# The engine-core measurement on one H200 (docs/benchmarks.md, issue: the engine core): bare, floor
# and served in one `recserve bench` on the 250k-row DLRM-v2-shaped model (bf16 dense, INT8 tables,
# 10 ids per bag, 8 front ends), with the engine's CPU per request and what it asks of the device
# per batch. GPU tests first with TESTS=1. Raw output goes to $OUT.
#   usage (on the device, from the repo root):  TESTS=1 bash scripts/gpu-engine.sh
set -uo pipefail
OUT="${OUT:-/tmp/recserve-engine}"; mkdir -p "$OUT"
ROWS="${ROWS:-250000}"; BATCHES="${BATCHES:-256,4096}"; CONCURRENCY="${CONCURRENCY:-1,16}"
FRONTENDS="${FRONTENDS:-8}"; DURATION="${DURATION:-4}"; TESTS="${TESTS:-0}"; BENCH="${BENCH:-1}"
source scripts/device-env.sh
nvidia-smi -L | tee "$OUT/env.txt"; nproc >> "$OUT/env.txt"
if [ "$TESTS" = 1 ]; then
  # The C++ loader's test needs the loader built (make cpp-loader), which a bare device machine lacks.
  [ -x cpp_loader/build/recserve-cpp-loader ] || SKIP_CPP="--deselect tests/test_cpp_loader.py"
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -x -m "gpu and not multigpu" \
    ${SKIP_CPP:-} tests > "$OUT/pytest_gpu.log" 2>&1
  tail -15 "$OUT/pytest_gpu.log"
fi
[ "$BENCH" = 1 ] || exit 0
source scripts/engine-model.sh
$RS bench --repo $W/repo --name v2 --batch-sizes $BATCHES --concurrency $CONCURRENCY --duration $DURATION \
  --ids-per-bag 10 --frontends $FRONTENDS --no-kernels --json "$OUT/engine.json" 2>&1 \
  | grep -v "^W11" > "$OUT/engine.txt"
grep -vE "^(bare|served|floor) +B=" "$OUT/engine.txt" | tail -40
