"""The engine's host CPU per batch, phase by phase (issue 21, engine CPU per request): the model
runner's launch (stage: copies in and descriptor; the model call: graph replay; the copies out) and
finish, on the thread that runs them, for one request per batch whose block lies in (a) torch's
page-locked memory, (b) a front end's shared buffer page-locked as the engine does it
(cudaHostRegister), (c) pageable memory. Prints a table (ms of thread CPU per batch).
  usage (on the device):  python3 scripts/gpu-launch-probe.py --repo R --name N [--batch-sizes 256,4096]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bare import host_requests  # noqa: E402
from recserve.manifest import read_manifest  # noqa: E402
from serving import ipc  # noqa: E402
from serving.engine.assemble import Item  # noqa: E402
from serving.engine.core import page_lock, page_unlock  # noqa: E402
from serving.engine.runner import ModelRunner  # noqa: E402
from serving.ipc import Schema  # noqa: E402


class Timed:
    """Wraps a callable; adds the calling thread's CPU seconds per call to ``self.seconds``."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.thread_time() - start


class Proxy:
    """The model call (a replay of a captured graph, or a capture or eager call), timed; its other
    attributes as they are."""

    def __init__(self, target, timed):
        self._target, self._timed = target, timed

    def __call__(self, *args):
        return self._timed(*args)

    def replay(self, *args):
        start = time.thread_time()
        try:
            return self._target.replay(*args)
        finally:
            self._timed.seconds += time.thread_time() - start

    def __getattr__(self, name):
        return getattr(self._target, name)


def in_arena(item: Item):
    """The item's block and result slot copied into a memfd arena page-locked by the engine's own
    page_lock; the moved item and what unlocks the arena (before its mapping goes: a new mapping at
    the same address could not be page-locked while the old range still is)."""
    arena = ipc.Arena(item.memory.numel())
    arena.touch()
    arena.bytes[:] = item.memory.numpy()
    locked = torch.cuda.is_available() and page_lock(arena)
    moved = Item(torch.from_numpy(arena.bytes), item.slot, item.block_bytes, item.result_at, item.batch_size,
                 item.extra, item.stored, item.ids)

    def release() -> None:
        if locked:
            torch.cuda.synchronize()
            page_unlock(arena)
    return moved, release


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repo", type=Path, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--batch-sizes", default="256,4096")
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    version_dir = sorted((args.repo / args.name).iterdir(), key=lambda d: int(d.name) if d.name.isdigit() else -1)[-1]
    manifest = read_manifest(version_dir)
    runner = ModelRunner(version_dir, manifest, Schema.from_manifest(manifest, max(sizes), max_ids=1 << 30))
    a = runner.assembler
    phases = {"stage": Timed(a.stage), "model call": Timed(runner.forward.__call__),
              "copies out": Timed(a.write_results)}
    a.stage, a.write_results = phases["stage"], phases["copies out"]
    runner.forward = Proxy(runner.forward, phases["model call"])
    print(f"copies and events through {'the CUDA runtime directly' if a.runtime is not None else 'torch'}"
          if hasattr(a, "runtime") else "copies and events through torch")
    print(f"{'memory':24} {'B':>5} {'launch':>8} {'stage':>8} {'model':>8} {'out':>8} {'finish':>8} "
          f"{'polls':>6} {'wall':>8}   (ms of thread CPU per batch; wall: launch to done)")
    for b in sizes:
        (pinned,) = host_requests(runner, manifest, b, 1, 10.0, seed=1)
        pageable = Item(pinned.memory.clone(), pinned.slot, pinned.block_bytes, pinned.result_at, pinned.batch_size,
                        pinned.extra, pinned.stored, pinned.ids)
        shared, release = in_arena(pinned)
        for label, item in (("torch page-locked", pinned), ("shared, cudaHostRegister", shared),
                            ("pageable", pageable)):
            for _ in range(10):
                runner.finish(runner.launch("Predict", [item]))
            for t in phases.values():
                t.seconds = 0.0
            launch = finish = wall = 0.0
            polls = 0
            for _ in range(args.calls):
                w0, c0 = time.perf_counter(), time.thread_time()
                handle = runner.launch("Predict", [item])
                c1 = time.thread_time()
                while not runner.ready(handle):
                    polls += 1
                wall += time.perf_counter() - w0
                c2 = time.thread_time()
                runner.finish(handle)
                launch += c1 - c0
                finish += time.thread_time() - c2
            n = args.calls / 1e3
            print(f"{label:24} {b:5d} {launch / n:8.3f} {phases['stage'].seconds / n:8.3f} "
                  f"{phases['model call'].seconds / n:8.3f} {phases['copies out'].seconds / n:8.3f} "
                  f"{finish / n:8.3f} {polls / args.calls:6.0f} {wall / n:8.3f}")
        release()


if __name__ == "__main__":
    main()
