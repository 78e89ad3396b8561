#!/usr/bin/env bash
# Triton's perf_analyzer (C++ load generator; wheel perf-analyzer 2.60.0, manylinux_2_38: it runs on
# the GPU machines, not on Debian 12) against `recserve serve` over the Open Inference Protocol (gRPC
# and HTTP/REST, with the server-side split from ModelStatistics), on the
# 250k-row DLRM-v2-shaped model of scripts/gpu-served.sh; then `recserve bench` on the same model in
# the same run, to compare (docs/benchmarks.md). Raw output goes to $OUT: perf_analyzer's CSV (-f) of
# every point in one file, its stdout in another, the server's log, bench's text and JSON.
# PROTOCOLS: grpc (a tensor per feature), grpc-packed (every feature in `lengths` and `ids`),
# grpc-shm (the packed form's tensors, and ctr, in system shared memory: perf_analyzer --shared-memory
# system; the server runs with --shared-memory system; perf_analyzer then refuses optional inputs, so
# these points run on model v2p, the same checkpoint exported again, with config.json oip_inputs
# "packed"), grpc-floor (the transport floor), grpc-both and http-both (both outputs: perf_analyzer's HTTP client
# sends no request parameters). PA_LIMIT_S: seconds each perf_analyzer point may take (default 60).
#   usage (on the device, from the repo root; the wheel in $PA_WHEELS):  bash scripts/gpu-perf-analyzer.sh
set -uo pipefail
OUT="${OUT:-/tmp/recserve-pa}"; mkdir -p "$OUT"
ROWS="${ROWS:-250000}"; BATCHES="${BATCHES:-256 4096}"; CONCURRENCY="${CONCURRENCY:-1 16}"; PROTOCOLS="${PROTOCOLS:-grpc grpc-packed grpc-shm grpc-floor grpc-both http-both}"
FRONTENDS="${FRONTENDS:-8}"; PORT="${PORT:-8001}"; FLOOR_PORT="${FLOOR_PORT:-8011}"; HTTP_PORT="${HTTP_PORT:-8000}"; WINDOW_MS="${WINDOW_MS:-2000}"; DEVICE="${DEVICE:-cuda}"
PA_WHEELS="${PA_WHEELS:-.whl-pa}"; PROFILE="${PROFILE-grpc:256:1 grpc:4096:1}"; BENCH="${BENCH:-1}"; DURATION="${DURATION:-3}"; BUDGET_S="${BUDGET_S:-420}"
[ "$DEVICE" = cuda ] && source scripts/device-env.sh
{ nvidia-smi -L 2>/dev/null; nproc; python3 --version; } > "$OUT/env.txt"
if [ -z "${PA:-}" ]; then  # the wheel holds one binary (glibc 2.38, libssl 3, no Python deps): no pip install
  python3 -m zipfile -e "$(ls "$PA_WHEELS"/perf_analyzer-*.whl | head -1)" /tmp/pa
  PA=/tmp/pa/perf_analyzer/bin/perf_analyzer; chmod +x $PA
fi
$PA --version >> "$OUT/env.txt" 2>&1

W=/tmp/recserve-pa-work; mkdir -p $W
# Triton's C++ client shares one gRPC channel (one connection) among up to 6 of perf_analyzer's
# concurrent workers: their requests then reach one front end of the server (the kernel spreads
# connections, not requests). One channel per worker, as a fleet of clients would be:
export TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT=1
# The server's own time per ModelInfer (receipt to response) from /metrics: "PORT" prints "sum count";
# "PORT sum count" prints the mean since then.
SERVER_TIME='
import re, sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10).read().decode()
total = [sum(float(v) for v in re.findall(r"^recserve_request_seconds_%s\{[^}]*rpc=\"ModelInfer\"[^}]*\} (\S+)" % k, text, re.M))
         for k in ("sum", "count")]
if len(sys.argv) == 2:
    print(*total)
else:
    n = total[1] - float(sys.argv[3])
    print(f"{(total[0] - float(sys.argv[2])) / n * 1000:.2f} ms over {n:.0f} requests" if n else "no requests")
'
RS="python3 -m recserve --log-level WARNING"
[ -f $W/ckpt/weights.pt ] || $RS bench-checkpoint --out $W/ckpt --rows-per-table $ROWS 2>&1 | tail -1
[ -d $W/repo/v2 ] || $RS export --checkpoint $W/ckpt --repo $W/repo --name v2 --device $DEVICE \
  $([ "$DEVICE" = cuda ] && echo --dense-dtype bf16) --no-progress 2>&1 | grep -v "^W11" | tail -3
case " $PROTOCOLS " in *" grpc-shm "*)
  grep -qs '"v2p"' $W/repo/v2p/1/manifest.json || { rm -rf $W/repo/v2p; $RS export --checkpoint $W/ckpt --repo $W/repo --name v2p --device $DEVICE \
    $([ "$DEVICE" = cuda ] && echo --dense-dtype bf16) --no-progress 2>&1 | grep -v "^W11" | tail -1; }
  echo '{"oip_inputs": "packed"}' > $W/repo/v2p/config.json;; esac
echo "model ready at ${SECONDS}s"
# recserve.v1 under the bench's Python client, profiled the same way (scripts/profile-served.py), for the same
# points (one front end where one client: the one it profiles is then the busy one).
for point in $PROFILE; do IFS=: read -r P B C <<< "$point"; [ $P = grpc ] || continue
  { echo "== recserve.v1 Predict B=$B clients=$C (scripts/profile-served.py)"
    timeout 90 python3 scripts/profile-served.py --repo $W/repo --name v2 --device $DEVICE --batch-size $B --clients $C \
      --frontends $([ $C = 1 ] && echo 1 || echo $FRONTENDS) --seconds 8 --out $W 2>&1 | grep -v "^W11"; } >> "$OUT/profiles.txt"
  echo "v1 profile B=$B clients=$C at ${SECONDS}s"
done

# PROFILE="P:B:C ..." (default grpc:256:1 grpc:4096:1; PROFILE= for none): py-spy (carried in .whl/) samples every server process for 8 s of that point, 3 s in;
# the busiest front end's self and inclusive time go to $OUT/profiles.txt (where a request's time goes).
profile_start() {
  rm -f $W/spy_*.txt; SPIES=""
  (sleep 3; for pid in $(pgrep -P $SERVER); do
     py-spy record --pid $pid --duration 8 --rate 500 --format raw --nonblocking -o $W/spy_$pid.txt >/dev/null 2>&1 &
   done; wait) &
  SPIES=$!
}
profile_summary() {
  local busiest; busiest=$(for f in $W/spy_*.txt; do [ -s $f ] && echo "$(awk '{n += $NF} END {print n}' $f) $f"; done \
    | sort -rn | head -2 | awk '{print $2}' | paste -sd,)
  { echo "== $1 (the two processes with the most samples: a front end and the engine)"
    [ -n "$busiest" ] && python3 scripts/profile-served.py --summarise "$busiest"; } >> "$OUT/profiles.txt" 2>&1
}

METRICS_PORT="${METRICS_PORT:-9400}"
$RS serve --repo $W/repo --port $PORT --http-port $HTTP_PORT --metrics-port $METRICS_PORT --device $DEVICE --frontends $FRONTENDS --shared-memory system \
  > "$OUT/serve.log" 2>&1 &
SERVER=$!
python3 -c "import sys; from recserve.local import wait_serving; sys.exit(0 if wait_serving('127.0.0.1:$PORT', 300) else 1)" \
  || { echo "server did not become ready"; tail -20 "$OUT/serve.log"; kill $SERVER; exit 1; }
until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$METRICS_PORT/metrics', timeout=2)" 2>/dev/null; do
  sleep 0.5; done  # the supervisor serves /metrics once the processes are up
echo "serving at ${SECONDS}s"
for B in $BATCHES; do
  python3 -m bench.oip_input --target 127.0.0.1:$PORT --model v2 --batch-size $B --ids-per-bag 10 --out $W/input_B$B.json
  # grpc-packed: the same requests with every feature in the inputs `lengths` [features, B] and `ids`
  case " $PROTOCOLS " in *" grpc-packed "*|*" grpc-shm "*)
    python3 -m bench.oip_input --target 127.0.0.1:$PORT --model v2 --batch-size $B --ids-per-bag 10 --packed \
      --out $W/input_packed_B$B.json;; esac
  # grpc-floor: perf_analyzer against the OIP transport floor (bench.floor --oip-proxy: ModelInfer answered
  # at once with a constant ctr, as many processes as front ends; metadata and statistics from the server):
  # what perf_analyzer and gRPC alone reach with these requests, the ceiling of the grpc rows.
  FLOOR=""
  case " $PROTOCOLS " in *" grpc-floor "*)
    python3 -m bench.floor --batch-size $B --processes $FRONTENDS --port $FLOOR_PORT --model v2 \
      --oip-proxy 127.0.0.1:$PORT > $W/floor.log 2>&1 &
    FLOOR=$!
    for _ in $(seq 120); do grep -q "listening" $W/floor.log && break; sleep 0.5; done;;
  esac
  for C in $CONCURRENCY; do for P in $PROTOCOLS; do
    # grpc: --request-parameter keeps only ctr (perf_analyzer requests every output): one Predict, as
    # recserve.v1's bench. perf_analyzer's HTTP client cannot send request parameters, so HTTP runs both
    # outputs (Predict + Lookup per request), and grpc-both is the same work over gRPC beside it.
    # perf_analyzer prints its client-side split (marshal, response wait) and, from ModelStatistics, the
    # engine's (queue, compute); the server's /metrics gives the whole server time per request.
    # Both outputs at B=4096 answer 54 MB of pooled rows per request: not a serving workload; left out.
    case "$P" in *-both) [ "$B" -gt 1024 ] && continue;; esac
    URL=127.0.0.1:$PORT; ONLY="--request-parameter outputs:ctr:string"; LIMIT=${PA_LIMIT_S:-60}; INPUT=$W/input_B$B.json
    case $P in grpc-packed|grpc-shm) INPUT=$W/input_packed_B$B.json;; esac
    # grpc-shm: perf_analyzer writes each input once into shared memory regions it registers, and each request
    # names them; ctr (4 bytes a sample) comes back in an output region.
    SHM=""; MODEL=v2; [ $P = grpc-shm ] && { SHM="--shared-memory system --output-shared-memory-size $((8 * B))"; MODEL=v2p; }
    # The floor's points name the version (-x): without it perf_analyzer takes the version whose queue count grew
    # in the server's statistics, and the floor's answers reach no queue.
    case $P in http*) URL=127.0.0.1:$HTTP_PORT; ONLY="";; grpc-both) ONLY="";;
      grpc-floor) URL=127.0.0.1:$FLOOR_PORT; ONLY="$ONLY -x $(python3 -c "from bench.floor import served_version; print(served_version('127.0.0.1:$PORT', 'v2'))")";; esac
    case $P in *-both) [ "$C" -gt 1 ] && LIMIT=40;; esac  # both outputs at 16 workers never settled: a bounded look
    BEFORE=$(python3 -c "$SERVER_TIME" $METRICS_PORT 2>/dev/null || echo "0 0")
    SPIES=""; case " $PROFILE " in *" $P:$B:$C "*) profile_start;; esac
    # -v: each measurement window's figures are printed as it ends, so a point that never settles
    # (perf_analyzer then prints no summary) still says what it measured.
    timeout $LIMIT $PA -v -i $(case $P in http*) echo http;; *) echo grpc;; esac) -u $URL -m $MODEL --input-data $INPUT $ONLY $SHM --concurrency-range $C \
      --measurement-interval $WINDOW_MS --max-trials 5 --stability-percentage 15 -f $W/pa.csv > $W/pa.txt 2>&1
    rc=$?
    [ -n "$SPIES" ] && { wait $SPIES; profile_summary "$P B=$B concurrency=$C"; }
    SERVED=$(python3 -c "$SERVER_TIME" $METRICS_PORT $BEFORE 2>&1 | tail -1)
    # Few files come back from the device: one CSV (a Batch column added) and one log for all points.
    [ -s "$OUT/perf_analyzer.csv" ] || head -1 $W/pa.csv 2>/dev/null | sed 's/^/Protocol,Batch,/' > "$OUT/perf_analyzer.csv"
    tail -n +2 $W/pa.csv 2>/dev/null | sed "s/^/$P,$B,/" >> "$OUT/perf_analyzer.csv"
    { echo "== $P B=$B concurrency=$C rc=$rc"; cat $W/pa.txt; } >> "$OUT/perf_analyzer.txt"
    echo "$P B=$B concurrency=$C rc=$rc at ${SECONDS}s"
    [ -s $W/pa.csv ] || grep -E "Pass \[[0-9]+\] throughput|p50 latency" $W/pa.txt | tail -6 | sed 's/^/  unsettled: /'
    [ -s $W/pa.csv ] && python3 - $W/pa.csv $B <<'PY'
import csv, sys
for row in csv.DictReader(open(sys.argv[1])):
    us = lambda name: float(row.get(name) or 0) / 1000  # the CSV's times are microseconds
    print(f"  {float(row['Inferences/Second']) * int(sys.argv[2]):.0f} samples/s, p50 {us('p50 latency'):.2f} ms, "
          f"p99 {us('p99 latency'):.2f} ms; client send {us('Client Send'):.2f} + network+server {us('Network+Server Send/Recv'):.2f} "
          f"+ client recv {us('Client Recv'):.2f} ms; server queue {us('Server Queue'):.2f}, compute infer "
          f"{us('Server Compute Infer'):.2f} ms")
PY
    [ $P = grpc-floor ] || echo "  server time per request (front end + engine, /metrics): $SERVED"
    rm -f $W/pa.csv
  done; done
  [ -n "$FLOOR" ] && { kill -TERM $FLOOR; wait $FLOOR; }
done
kill -TERM $SERVER; wait $SERVER
rm -rf $W/repo/v2p  # bench serves the repository: v2 alone

if [ "$BENCH" = 1 ] && [ $SECONDS -lt $((BUDGET_S - 120)) ]; then
  timeout $((BUDGET_S - SECONDS - 10)) $RS bench --repo $W/repo --name v2 --batch-sizes "${BATCHES// /,}" \
    --concurrency "${CONCURRENCY// /,}" --duration $DURATION --ids-per-bag 10 --frontends $FRONTENDS --no-kernels \
    --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
  echo "bench rc=$? at ${SECONDS}s"; grep -E "^(bare|served|floor) " "$OUT/bench.txt" | head -30
fi
