#!/usr/bin/env bash
# The benchmark run on an H200 (docs/benchmarks.md): a DLRM-v2-shaped checkpoint, exported with our
# CLI for each dense precision in $DTYPES, measured by `recserve bench`. Raw figures go to $OUT.
#   usage (on the device, from the repo root):  ROWS=250000 DTYPES="tf32 fp32" bash scripts/gpu-bench.sh
set -uo pipefail
OUT="${OUT:-/tmp/recserve-bench}"; mkdir -p "$OUT"
ROWS="${ROWS:-250000}"; DTYPES="${DTYPES:-tf32}"; BATCHES="${BATCHES:-256,4096,16384}"
SERVED_DTYPES="${SERVED_DTYPES:-$DTYPES}"; FRONTENDS="${FRONTENDS:-8}"; DURATION="${DURATION:-4}"; CONCURRENCY="${CONCURRENCY:-1,8}"
source scripts/device-env.sh
W=/tmp/recserve-bench-work; mkdir -p $W
RS="python3 -m recserve --log-level WARNING"
[ -f $W/ckpt/weights.pt ] || { /usr/bin/time -f "checkpoint: %e s, %M KB peak" $RS bench-checkpoint --out $W/ckpt --rows-per-table $ROWS 2>&1 | tail -2; }
for d in $DTYPES; do
  if [ ! -d $W/repo/v2_$d ]; then
    /usr/bin/time -f "export $d: %e s wall, %M KB peak" $RS export --checkpoint $W/ckpt --repo $W/repo --name v2_$d \
      --device cuda --dense-dtype $d --no-progress 2>&1 | grep -v "^W11" | tail -6 | tee -a "$OUT/export_$d.log"
  fi
  served=--no-served; case " $SERVED_DTYPES " in *" $d "*) served=;; esac
  kernels=--no-kernels; [ "$d" = "$(echo $DTYPES | cut -d' ' -f1)" ] && kernels=
  $RS bench --repo $W/repo --name v2_$d --batch-sizes $BATCHES --duration $DURATION --concurrency $CONCURRENCY \
    --ids-per-bag 10 --frontends $FRONTENDS $served $kernels --json "$OUT/bench_${d}_f$FRONTENDS.json" \
    --plot "$OUT/bench_${d}_f$FRONTENDS.png" 2>&1 | grep -v "^W11" | tee "$OUT/bench_${d}_f$FRONTENDS.txt" | tail -18
done
