#!/usr/bin/env bash
# Tables larger than a GPU budget (docs/benchmarks.md, issue 16), on one H200: a DLRM-v2-shaped
# checkpoint (26 tables of $ROWS x 128, random weights) exported three times with our CLI - all
# tables in HBM, all uvm (host memory, no cache), all uvm_caching (host memory behind an HBM cache of
# $LOAD_FACTOR x rows) - then `recserve bench`: bare throughput at $BATCHES with zipf:$ALPHA and
# uniform ids (cache hit ratio per run), and the served rate at $SERVED_BATCH of the cached and the
# all-HBM model. Raw output goes to $OUT; steps already done in $W are skipped (a rerun resumes).
#   usage (on the device, from the repo root):  ROWS=1000000 bash scripts/gpu-uvm.sh
#   (MODELS="cached": only that export and its runs)
set -uo pipefail
OUT="${OUT:-/tmp/recserve-uvm}"; mkdir -p "$OUT"
ROWS="${ROWS:-1000000}"; LOAD_FACTOR="${LOAD_FACTOR:-0.2}"; ALPHA="${ALPHA:-1.05}"
BATCHES="${BATCHES:-4096,65536}"; SERVED_BATCH="${SERVED_BATCH:-4096}"; DURATION="${DURATION:-2}"
CONCURRENCY="${CONCURRENCY:-8}"; FRONTENDS="${FRONTENDS:-8}"; MODELS="${MODELS:-hbm uvm cached}"
source scripts/device-env.sh
W=/tmp/recserve-uvm-work; mkdir -p $W
RS="python3 -m recserve --log-level WARNING"
[ -f $W/ckpt/weights.pt ] || /usr/bin/time -f "checkpoint: %e s" $RS bench-checkpoint --out $W/ckpt --rows-per-table $ROWS 2>&1 | tail -1 | tee "$OUT/checkpoint.log"
python3 - "$W" "$LOAD_FACTOR" <<'PY'
import json, sys
w, lf = sys.argv[1], float(sys.argv[2])
names = [t["name"] for t in json.load(open(f"{w}/ckpt/model_config.json"))["tables"]]
for placement, spec in (("uvm", {"placement": "uvm"}), ("cached", {"placement": "uvm_caching", "cache_load_factor": lf})):
    json.dump({"tables": {n: spec for n in names}}, open(f"{w}/plan-{placement}.json", "w"))
PY
for m in $MODELS; do
  plan=""; [ $m != hbm ] && plan="--plan $W/plan-$m.json"
  [ -d $W/repo/$m/1 ] || /usr/bin/time -f "export $m: %e s wall, %M KB peak" $RS export --checkpoint $W/ckpt --repo $W/repo \
      --name $m --device cuda $plan --no-progress 2>&1 | grep -v "^W11" | tail -6 | tee "$OUT/export_$m.log"
done
[ -d $W/repo/cached/1 ] && $RS inspect $W/repo/cached/1 2>&1 | tee "$OUT/inspect_cached.txt" | grep -E "tables|t0 |placement" | head -4
wanted() { case " $MODELS " in *" $1 "*) [ -d $W/repo/$1/1 ];; *) false;; esac; }
bare() {  # model ids label
  [ -f "$OUT/$3.json" ] || ! wanted $1 && return
  $RS bench --repo $W/repo --name $1 --batch-sizes $BATCHES --duration $DURATION --no-served --no-kernels \
    --id-distribution $2 --json "$OUT/$3.json" 2>&1 | grep -v "^W11" > "$OUT/$3.txt"
  echo "== $3"; grep -E "^bare |cache hit|GPU memory|CUDA graphs" "$OUT/$3.txt"
}
served() {  # model label
  [ -f "$OUT/$2.json" ] || ! wanted $1 && return
  $RS bench --repo $W/repo --name $1 --batch-sizes $SERVED_BATCH --duration $DURATION --concurrency $CONCURRENCY \
    --frontends $FRONTENDS --no-floor --no-kernels --id-distribution zipf:$ALPHA --json "$OUT/$2.json" 2>&1 \
    | grep -v "^W11" > "$OUT/$2.txt"
  echo "== $2"; grep -E "^(bare|served) |cache hit|memory" "$OUT/$2.txt"
}
bare hbm zipf:$ALPHA bare_hbm_zipf
bare cached zipf:$ALPHA bare_cached_zipf
bare cached uniform bare_cached_uniform
bare hbm uniform bare_hbm_uniform
bare uvm zipf:$ALPHA bare_uvm_zipf
served cached served_cached_zipf
served hbm served_hbm_zipf
bare uvm uniform bare_uvm_uniform
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, fbgemm_gpu, torchrec; print(torch.__version__, fbgemm_gpu.__version__, torchrec.__version__)" >> "$OUT/gpu.txt"
