# Sourced by the scripts/gpu-*.sh runs on the device machine, from the repo root: the bundle
# (fbgemm-gpu, torchrec; ../shared/device/README.md), the wheels carried in .whl/ (installed once per
# machine), and this tree on PYTHONPATH.
source .devbundle/on-device.sh
[ -d /tmp/site/grpc_health ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH"
