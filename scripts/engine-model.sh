# Sourced by the measurements on the device (scripts/gpu-engine.sh, gpu-ab.sh, gpu-served.sh,
# gpu-shared.sh, docs/engine/*/run.sh), after scripts/device-env.sh and with OUT set: the
# DLRM-v2-shaped model of docs/benchmarks.md (ROWS rows per table, default 250000; bf16 dense, INT8
# tables), made and exported once per machine into $W/repo as "v2" (W: /tmp/recserve-engine-work
# unless set; the export's last lines in $OUT/export.log). RS runs recserve.
W="${W:-/tmp/recserve-engine-work}"; mkdir -p "$W"
RS="python3 -m recserve --log-level WARNING"
[ -f $W/ckpt/weights.pt ] || $RS bench-checkpoint --out $W/ckpt --rows-per-table "${ROWS:-250000}" 2>&1 | tail -1
[ -d $W/repo/v2 ] || $RS export --checkpoint $W/ckpt --repo $W/repo --name v2 --device cuda --dense-dtype bf16 \
  --no-progress 2>&1 | grep -v "^W11" | tail -3 | tee "$OUT/export.log"
