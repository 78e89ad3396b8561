#!/usr/bin/env bash
# Shared features on one H200 (docs/benchmarks.md "Shared features"): the GPU test of shared bags
# (bitwise equal to the per-sample form), then one `recserve bench` of ranking requests on the
# 250k-row DLRM-v2-shaped model: 1 user x B candidates, the first 13 of 26 features one bag of
# Poisson(50) ids per request, the other 13 Poisson(10) ids per candidate; each served and floor row
# with the shared bags sent once and repeated per candidate (same requests, same clients, one run).
#   usage (on the device, from the repo root):  bash scripts/gpu-shared.sh
set -uo pipefail
OUT="${OUT:-/tmp/recserve-shared}"; mkdir -p "$OUT"
ROWS="${ROWS:-250000}"; BATCHES="${BATCHES:-512}"; CONCURRENCY="${CONCURRENCY:-1,4,16}"
FRONTENDS="${FRONTENDS:-8}"; DURATION="${DURATION:-3}"; TESTS="${TESTS:-1}"
source scripts/device-env.sh
nvidia-smi -L | tee "$OUT/env.txt"; nproc >> "$OUT/env.txt"
if [ "$TESTS" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_serving.py -k "cuda_matches or shared" \
    > "$OUT/pytest_shared_gpu.log" 2>&1; tail -3 "$OUT/pytest_shared_gpu.log"
fi
W=/tmp/recserve-served-work
source scripts/engine-model.sh
# The server expands shared bags on the GPU (default), then pools them once (--shared-pooling once).
for pooling in ${POOLING:-expand once}; do
  $RS bench --repo $W/repo --name v2 --batch-sizes $BATCHES --concurrency $CONCURRENCY --duration $DURATION \
    --ids-per-bag 10 --shared-features 13 --shared-ids-per-bag 50 --shared-pooling $pooling --max-batch-size ${MAX_BATCH:-4096} --frontends $FRONTENDS \
    --no-kernels $([ $pooling = once ] && echo --no-floor) --json "$OUT/shared_$pooling.json" 2>&1 \
    | grep -v "^W11" > "$OUT/shared_$pooling.txt"
  echo "== shared pooling: $pooling"; grep -vE "^ {4}|^(bare|served|floor) +B=" "$OUT/shared_$pooling.txt" | tail -30
done
