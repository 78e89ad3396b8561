#!/usr/bin/env bash
# The served-path run on one H200 (docs/benchmarks.md, issue: the served path): GPU tests of the
# serving path, then bare / floor / served in one `recserve bench` per front-end count, on the
# 250k-row DLRM-v2-shaped model (bf16 dense, INT8 tables, 10 ids per bag). With $BEFORE (a checkout
# of the previous server), the same bench through it first. Raw output goes to $OUT.
#   usage (on the device, from the repo root):  BEFORE=.before bash scripts/gpu-served.sh
set -uo pipefail
OUT="${OUT:-/tmp/recserve-served}"; mkdir -p "$OUT"
ROWS="${ROWS:-250000}"; BATCHES="${BATCHES:-256,1024,4096}"; CONCURRENCY="${CONCURRENCY:-1,4,16}"
FRONTENDS="${FRONTENDS:-8}"; DURATION="${DURATION:-4}"; BEFORE="${BEFORE:-}"; TESTS="${TESTS:-1}"
source scripts/device-env.sh
nvidia-smi -L | tee "$OUT/env.txt"; nproc >> "$OUT/env.txt"
if [ "$TESTS" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "gpu and not multigpu" tests > "$OUT/pytest_gpu.log" 2>&1
  tail -3 "$OUT/pytest_gpu.log"
fi
W=/tmp/recserve-served-work
source scripts/engine-model.sh
if [ -n "$BEFORE" ]; then
  (cd $BEFORE && PYTHONPATH="$PWD:/tmp/site" $RS bench --repo $W/repo --name v2 --batch-sizes $BATCHES \
    --concurrency $CONCURRENCY --duration $DURATION --ids-per-bag 10 --no-kernels --json "$OUT/before.json" 2>&1 \
    | grep -v "^W11" > "$OUT/before.txt"); echo "== before"; grep -E "^(mode|bare |served )" "$OUT/before.txt"
fi
for f in $FRONTENDS; do
  $RS bench --repo $W/repo --name v2 --batch-sizes $BATCHES --concurrency $CONCURRENCY --duration $DURATION \
    --ids-per-bag 10 --frontends $f --no-kernels --json "$OUT/after_f$f.json" --plot "$OUT/after_f$f.png" 2>&1 \
    | grep -v "^W11" > "$OUT/after_f$f.txt"
  echo "== after, $f frontends"; grep -vE "^ {4}|^(bare|served|floor) +B=" "$OUT/after_f$f.txt" | tail -30
done
