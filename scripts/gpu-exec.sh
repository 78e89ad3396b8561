#!/usr/bin/env bash
# GPU execution before/after (docs/benchmarks.md, issue: fast GPU execution), on one H200.
# "before": the artifact as the previous export wrote it ($BEFORE: a checkout of that commit), run
# eagerly; "after": this tree's export, eager and with CUDA graphs. Raw output goes to $OUT.
#   usage (on the device, from the repo root):  BEFORE=.before ROWS=250000 bash scripts/gpu-exec.sh
set -uo pipefail
OUT="${OUT:-/tmp/recserve-exec}"; mkdir -p "$OUT"
ROWS="${ROWS:-250000}"; DTYPES="${DTYPES:-bf16 tf32 fp32}"; BATCHES="${BATCHES:-256,4096,16384,65536}"
BREAKDOWN="${BREAKDOWN:-4096,65536}"; DURATION="${DURATION:-3}"; BEFORE="${BEFORE:-}"
source scripts/device-env.sh
W=/tmp/recserve-exec-work; mkdir -p $W
RS="python3 -m recserve --log-level WARNING"
[ -f $W/ckpt/weights.pt ] || /usr/bin/time -f "checkpoint: %e s" $RS bench-checkpoint --out $W/ckpt --rows-per-table $ROWS 2>&1 | tail -1
bench() {  # repo name label extra-args...
  local repo=$1 name=$2 label=$3; shift 3
  $RS bench --repo $repo --name $name --batch-sizes $BATCHES --duration $DURATION --no-served --no-kernels \
    --breakdown $BREAKDOWN --json "$OUT/$label.json" "$@" 2>&1 | grep -v "^W11" > "$OUT/$label.txt"
  echo "== $label"; grep -v "^ \{4\}" "$OUT/$label.txt" | tail -14
}
for d in $DTYPES; do
  if [ -n "$BEFORE" ] && [ ! -d $W/before/v2_$d ]; then
    (cd $BEFORE && PYTHONPATH="$PWD:/tmp/site" $RS export --checkpoint $W/ckpt --repo $W/before --name v2_$d \
      --device cuda --dense-dtype $d --no-progress 2>&1 | grep -v "^W11" | tail -4 > "$OUT/export_before_$d.log")
  fi
  [ -d $W/after/v2_$d ] || /usr/bin/time -f "export $d: %e s wall, %M KB peak" $RS export --checkpoint $W/ckpt --repo $W/after --name v2_$d --device cuda \
      --dense-dtype $d --no-progress 2>&1 | grep -v "^W11" | tail -5 | tee "$OUT/export_after_$d.log"
  [ -n "$BEFORE" ] && bench $W/before v2_$d before_${d}_eager --no-cuda-graphs
  [ "$d" = bf16 ] && bench $W/after v2_$d after_${d}_eager --no-cuda-graphs
  bench $W/after v2_$d after_${d}_graphs
  BEFORE=  # the previous export only for the first dtype
done
