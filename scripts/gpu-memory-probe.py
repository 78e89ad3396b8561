import sys, collections
from pathlib import Path
sys.path.insert(0, '.')
import torch, fbgemm_gpu  # noqa
from recserve.manifest import load_verified
from serving.engine.runner import ModelRunner
from serving.ipc import Schema
from bench.bare import host_requests
import serving.engine.graphs as graphs
if len(sys.argv) > 2:
    graphs.WARMUP_RUNS = int(sys.argv[2])
if len(sys.argv) > 3 and sys.argv[3] == "legacy":
    torch._C._jit_set_profiling_executor(False)
path = Path(sys.argv[1]); m = load_verified(path)
torch.cuda.memory._record_memory_history(max_entries=200000)
r = ModelRunner(path, m, Schema.from_manifest(m, 4096, 1 << 23), "cuda:0")
r.check_golden(path)
print("after golden", torch.cuda.memory_allocated() / 2**30)
for i in range(12):
    b = (4096, 256, 1024)[i % 3]
    r.finish(r.launch("Predict", host_requests(r, m, b, 1 + i % 2, 10.0, seed=i)))
torch.cuda.synchronize()
print("after batches", torch.cuda.memory_allocated() / 2**30, "graphs", r.forward.captured, "pool", r.forward.pool_bytes() / 2**30)
snap = torch.cuda.memory._snapshot()
live = collections.Counter()
for seg in snap["segments"]:
    pool = tuple(seg.get("segment_pool_id", ()))
    for blk in seg["blocks"]:
        if blk["state"] != "active_allocated" or blk["size"] < (1 << 20):
            continue
        frames = blk.get("frames", [])
        where = " < ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in frames if f['filename'].endswith('.py'))[:300]
        live[(pool != (0, 0), where)] += blk["size"]
for (in_pool, where), size in live.most_common(15):
    print(f"{size / 2**20:9.1f} MiB {'pool ' if in_pool else 'heap '} {where}")
