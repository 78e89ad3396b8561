# Sourced by the scripts/gpu-*.sh runs on the device machine, from the repo root: the bundle
# (fbgemm-gpu, torchrec; ../shared/device/README.md), the wheels carried in .whl/ (installed once per
# machine), and this tree on PYTHONPATH.
source .devbundle/on-device.sh
# Installed again whenever the set of wheels changes (a marker named after their list).
marker="/tmp/site/.wheels-$(ls .whl | sha256sum | cut -c1-16)"
[ -f "$marker" ] || { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
  && touch "$marker"; }
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH"
