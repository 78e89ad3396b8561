#!/usr/bin/env bash
# Shared features, this tree against OLD (a copy of another commit: `git archive <commit> | tar -x -C old`)
# on one machine, alternating ROUNDS times: the front end's read and layout of a ranking request
# (`python -m bench.decode --shared-features 13`, B=512), then `recserve bench` of ranking requests
# as scripts/gpu-shared.sh runs it (B=512, 16 clients, --shared-pooling POOLING, no floor).
#   usage (on the device, from the repo root):  OLD=old ROUNDS=2 bash docs/shared/ab_h200/run.sh
set -uo pipefail
OUT="${OUT:-/tmp/recserve-shared-ab}"; mkdir -p "$OUT"; OLD="${OLD:?a copy of the other tree}"; ROUNDS="${ROUNDS:-2}"
source scripts/device-env.sh
source scripts/engine-model.sh
run() {  # run TREE LABEL
  (cd "$1" && PYTHONPATH="$PWD:/tmp/site" python3 -m bench.decode --batch-sizes 512 --shared-features 13 \
     --number 300 --repeats 7 > "$OUT/decode_$2.txt" 2>&1
   PYTHONPATH="$PWD:/tmp/site" $RS bench --repo $W/repo --name v2 --batch-sizes 512 --concurrency 16 \
     --duration "${DURATION:-4}" --ids-per-bag 10 --shared-features 13 --shared-ids-per-bag 50 \
     --shared-pooling "${POOLING:-once}" --max-batch-size 4096 --frontends 8 --no-kernels --no-floor \
     --json "$OUT/$2.json" 2>&1 | grep -v "^W11" > "$OUT/$2.txt")
  echo "== $2"; grep -E "v1 shared|recserve.v1" "$OUT/decode_$2.txt"; grep -E "^served |shared/per-sample|^served +512|16 clients:" "$OUT/$2.txt"
}
for i in $(seq "$ROUNDS"); do run . "new$i"; run "$OLD" "old$i"; done
(cd "$OUT" && tar -czf ab.tar.gz --remove-files -- *.json *.txt)
