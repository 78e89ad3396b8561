# The phase measurement of docs/benchmarks.md ("The engine's loop phase by phase"): apply phases.patch
# (git apply docs/engine/phases_h200/phases.patch), then on the device: bash docs/engine/phases_h200/run.sh.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/device-env.sh
source scripts/engine-model.sh
for cfg in "4096 16" "256 1" "4096 1"; do set -- $cfg
  RECSERVE_PHASES=$OUT/ph_$1x$2 $RS bench --repo $W/repo --name v2 --batch-sizes $1 --concurrency $2 --duration 4 --ids-per-bag 10 --frontends 8 --no-kernels 2>&1 | grep -E "^served +[0-9]|clients:"
  for f in $OUT/ph_$1x$2.*; do echo "-- $f"; cat $f; done
done
