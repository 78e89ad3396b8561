# Issue 21's second lever, measured (docs/benchmarks.md "More requests per launch"): B=4096 requests
# from 16 clients, the server's max batch size 4096 (the bench's default: no two requests merge) or
# 16384 (up to four merge into one launch), alternated on one machine; and the bare model at B=16384.
#   usage (on the device, from the repo root):  ROUNDS=2 bash docs/engine/merge_h200/run.sh
#   (rounds FIRST..ROUNDS; the bare row with the first round)
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/device-env.sh
source scripts/engine-model.sh
run() {  # LABEL BENCH-FLAGS...
  local label=$1; shift
  $RS bench --repo $W/repo --name v2 --ids-per-bag 10 --frontends 8 --no-kernels --duration "${DURATION:-4}" \
    --json "$OUT/$label.json" "$@" 2>&1 | grep -v "^W11" > "$OUT/$label.txt"
  echo "== $label"; grep -E "^(served|bare) |clients: |^  B=" "$OUT/$label.txt"
}
[ "${FIRST:-1}" = 1 ] && run bare16384 --batch-sizes 16384 --no-served
for i in $(seq "${FIRST:-1}" "${ROUNDS:-1}"); do
  run "max4096_$i" --batch-sizes 4096 --concurrency "${CONCURRENCY:-16}" $([ "$i" = 1 ] || echo --no-floor)
  run "max16384_$i" --batch-sizes 4096 --concurrency "${CONCURRENCY:-16}" --max-batch-size 16384 --no-floor
done
