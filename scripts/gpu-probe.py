"""Where does a served model's GPU memory go? Loads one artifact three ways and prints
torch.cuda.memory_allocated after each step (used for docs/benchmarks.md, target 4)."""
import sys
from pathlib import Path

import logging

import torch

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fbgemm_gpu  # noqa: E402,F401

from recserve.manifest import load_verified  # noqa: E402
from serving.engine.runner import ModelRunner  # noqa: E402
from serving.ipc import Schema  # noqa: E402

path = Path(sys.argv[1])
m = load_verified(path)
gib = lambda: torch.cuda.memory_allocated(0) / 2**30  # noqa: E731
print(f"model bytes {(m.table_bytes + m.dense_bytes) / 2**30:.3f} GiB")
mod = torch.jit.load(str(path / "model.pt"), map_location="cuda:0")
print(f"torch.jit.load: {gib():.3f} GiB")
del mod
torch.cuda.empty_cache()
print(f"freed: {gib():.3f} GiB")
schema = Schema.from_manifest(m, int(sys.argv[3]) if len(sys.argv) > 3 else 4096, 1 << 28)
r = ModelRunner(path, m, schema, "cuda:0")
print(f"ModelRunner: {gib():.3f} GiB")
r.check_golden(path)
print(f"after golden: {gib():.3f} GiB")
held = {}
for n, b in r.module.named_buffers():
    if b.is_cuda and b.numel() * b.element_size() > 2**26:
        held[n] = b.numel() * b.element_size() / 2**30
print("large buffers:", {k: round(v, 3) for k, v in held.items()})
if len(sys.argv) > 2:  # batch sizes to run through Predict's model call (CUDA graphs as served)
    from bench.bare import host_requests

    for i, b in enumerate(int(x) for x in sys.argv[2].split(",")):
        r.finish(r.launch("Predict", host_requests(r, m, b, 1, 10.0, seed=i)))
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats(0)
        print(f"after a batch of {b} ({r.forward.captured} graphs): {gib():.3f} GiB allocated, "
              f"{torch.cuda.memory_reserved(0) / 2**30:.3f} GiB reserved, "
              f"{stats.get('active_bytes.all.current', 0) / 2**30:.3f} GiB active")
