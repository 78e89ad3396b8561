#!/usr/bin/env bash
# The 2-GPU run (issue: across GPUs), on an nvidia-h200-x2 machine: multi-GPU tests, then replicas
# (1 vs 2 GPUs, same client load) and a 2-GPU sharded model vs the same model on 1 GPU.
#   usage (on the device, from the repo root):  bash scripts/gpu-multi.sh
set -uo pipefail
OUT="${OUT:-/tmp/recserve-multi}"; mkdir -p "$OUT"
source scripts/device-env.sh
nvidia-smi -L | tee "$OUT/env.txt"
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_scaleout.py tests/test_export.py -k "gpu or two or planner or replicas or cuda" > "$OUT/pytest.log" 2>&1; tail -3 "$OUT/pytest.log"
W=/tmp/multi; mkdir -p $W; RS="python3 -m recserve --log-level WARNING"
ROWS="${ROWS:-2000000}"; MEM="${MEM:-5}"
$RS bench-checkpoint --out $W/ckpt --rows-per-table $ROWS --force 2>&1 | tail -1
# fp32 dense: the GPU, not the wire, is the limit, so replicas can show their worth.
/usr/bin/time -f "export 1gpu: %e s" $RS export --checkpoint $W/ckpt --repo $W/repo --name one --device cuda --dense-dtype fp32 --no-progress 2>&1 | grep -E "tables|export 1gpu|error"
/usr/bin/time -f "export 2gpu: %e s" $RS export --checkpoint $W/ckpt --repo $W/repo --name two --device cuda --world-size 2 --device-memory-gb $MEM --dense-dtype fp32 --no-progress 2>&1 | grep -E "tables|export 2gpu|error|sharded_vs"
$RS inspect $W/repo/two/1 | sed -n 3,8p
B="--batch-sizes 4096 --duration 4 --concurrency 16 --ids-per-bag 10 --frontends 8 --no-kernels"
for r in 1 2; do
  $RS bench --repo $W/repo --name one $B --replicas $r --json "$OUT/replicas_$r.json" 2>&1 | grep -E "^(mode|bare |served )" | tee "$OUT/replicas_$r.txt"
done
$RS bench --repo $W/repo --name two $B --json "$OUT/sharded2.json" 2>&1 | grep -E "^(mode|bare |served )" | tee "$OUT/sharded2.txt"
