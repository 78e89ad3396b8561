# The uvloop A/B of docs/benchmarks.md ("uvloop tried"): apply uvloop.patch to the tree first (git apply
# docs/engine/uvloop_h200/uvloop.patch), then on the device: ROUNDS=2 bash docs/engine/uvloop_h200/ab.sh.
# Run 1 also had a variant with RECSERVE_LOOP_ENGINE=uvloop alone. uvloop's cp312 wheel goes in .whl/ (pip download uvloop==0.23.0 --python-version 3.12 --only-binary=:all:).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/device-env.sh
source scripts/engine-model.sh
python3 -c "import uvloop; print('uvloop', uvloop.__version__)"
run() {  # LABEL ENV...
  local label=$1; shift
  env "$@" $RS bench --repo $W/repo --name v2 --batch-sizes "${BATCHES:-256,4096}" --concurrency "${CONCURRENCY:-1,16}" \
    --duration "${DURATION:-3}" --ids-per-bag 10 --frontends 8 --no-kernels --json "$OUT/$label.json" 2>&1 | grep -v "^W11" > "$OUT/$label.txt"
  echo "== $label"; grep -E "^(served) |clients: |^  B=" "$OUT/$label.txt"
}
for i in $(seq "${ROUNDS:-1}"); do
  run "asyncio$i" X=1
  run "both$i" RECSERVE_LOOP_ENGINE=uvloop RECSERVE_LOOP_FRONTEND=uvloop
done
(cd "$OUT" && tar -czf ab.tar.gz --remove-files -- *.json *.txt)
