#!/usr/bin/env bash
# Two trees in one device call (the spread between machines of one kind is larger than most effects
# here): `recserve bench` as scripts/gpu-engine.sh runs it, on this tree and on OLD (a copy of
# another commit, e.g. `git archive <commit> | tar -x -C old`), alternating ROUNDS times. OLD_ENV:
# environment assignments for the OLD runs only (OLD=. OLD_ENV='NAME=value' compares a setting on this tree).
#   usage (on the device, from the repo root):  OLD=old ROUNDS=1 bash scripts/gpu-ab.sh
set -uo pipefail
OUT="${OUT:-/tmp/recserve-ab}"; mkdir -p "$OUT"; OLD="${OLD:?a copy of the other tree}"; ROUNDS="${ROUNDS:-1}"
source scripts/device-env.sh
source scripts/engine-model.sh
run() {  # run TREE LABEL [ENV]
  (cd "$1" && env ${3:-} PYTHONPATH="$PWD:/tmp/site" $RS bench --repo $W/repo --name v2 --batch-sizes "${BATCHES:-256,4096}" \
     --concurrency "${CONCURRENCY:-1,16}" --duration "${DURATION:-4}" --ids-per-bag 10 --frontends "${FRONTENDS:-8}" \
     --no-kernels --json "$OUT/$2.json" 2>&1 | grep -v "^W11" > "$OUT/$2.txt")
  echo "== $2"; grep -E "^(bare|floor|served) |clients: " "$OUT/$2.txt"
}
for i in $(seq "$ROUNDS"); do run . "new$i"; run "$OLD" "old$i" "${OLD_ENV:-}"; done
# The device tool brings back at most 8 files: the rounds' JSON and text in one archive.
(cd "$OUT" && tar -czf ab.tar.gz --remove-files -- *.json *.txt)
