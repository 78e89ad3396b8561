#!/usr/bin/env bash
# The GPU checks as run on an H200 machine of the `device` tool (see ../shared/device/README.md):
# no virtual environment there, the image's python3 (torch 2.11) plus .devbundle (fbgemm-gpu 1.6.0,
# torchrec 1.6.1) and .whl (grpcio-health-checking / grpcio-reflection). Logs go to $OUT.
#   usage (on the device, from the repo root):  bash scripts/gpu-checks.sh [pytest args]
set -uo pipefail
OUT="${OUT:-/tmp/recserve-gpu}"
mkdir -p "$OUT"
source scripts/device-env.sh
{
  nvidia-smi -L
  python3 -c "import torch, fbgemm_gpu, torchrec, grpc, google.protobuf as p; print('torch', torch.__version__, '| fbgemm_gpu', fbgemm_gpu.__version__, '| torchrec', getattr(torchrec, '__version__', '?'), '| grpcio', grpc.__version__, '| protobuf', p.__version__, '| cuda devices', torch.cuda.device_count())" 2>&1 | grep -v INFO
} | tee "$OUT/env.txt"
start=$(date +%s)
cmake -S cpp_loader -B cpp_loader/build -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')" \
  -DFBGEMM_DIR=/tmp/site/fbgemm_gpu > "$OUT/cpp_build.log" 2>&1 \
  && cmake --build cpp_loader/build -j 16 >> "$OUT/cpp_build.log" 2>&1 \
  && echo "cpp loader built in $(( $(date +%s) - start ))s" | tee -a "$OUT/env.txt" \
  || { echo "cpp loader build failed"; tail -30 "$OUT/cpp_build.log"; }
python3 -m pytest -q -p no:cacheprovider -o addopts="" "${@:-tests}" 2>&1 | tee "$OUT/pytest.log" | tail -40
