"""What the host pays for its calls to the device (issue 21, engine CPU per request), two tables:

1. one `dst.copy_(src, non_blocking=True)` host-to-device call: its host CPU time by size and by
   kind of source memory (torch's page-locked allocator, a shared-memory mapping page-locked with
   cudaHostRegister as the engine does with a front end's buffer, pageable), with the wall time to
   the copy's end beside it; also the device's confidential-computing state (its copies would then
   go through CPU-encrypted bounce buffers);
2. waiting for about a millisecond of device work: the waiting thread's CPU time when it polls the
   event (as the engine's loop does), calls synchronize() on a default event, or on a blocking one
   (cudaEventBlockingSync), and how late each sees the end.
  usage (on the device):  python3 scripts/gpu-host-probe.py [--sizes-mb 0.3,1.2,4.9] [--calls 200]
"""
import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving import ipc  # noqa: E402
from serving.engine.core import page_lock, page_unlock  # noqa: E402


def confidential_state() -> str:
    try:
        text = subprocess.run(["nvidia-smi", "conf-compute", "-f"], capture_output=True, text=True, timeout=20)
        return (text.stdout or text.stderr).strip().replace("\n", " ") or "unknown"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"


def sources(nbytes: int):
    """(label, tensor) per kind of source memory, and what unlocks the shared buffer (a later
    mapping at the same address could not be page-locked while this one still is)."""
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    arena = ipc.Arena(nbytes)  # a front end's shared buffer, page-locked as the engine does it
    arena.bytes[:] = 1
    locked = page_lock(arena)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    kinds = [("torch pinned", pinned), (f"shm + cudaHostRegister ({'ok' if locked else 'refused'})",
                                        torch.from_numpy(arena.bytes)), ("pageable", pageable)]
    return kinds, lambda: page_unlock(arena) if locked else None


def measure(dst: torch.Tensor, src: torch.Tensor, calls: int):
    stream = torch.cuda.current_stream()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    cpu = wall_call = 0.0
    start = time.perf_counter()
    for _ in range(calls):
        c0, w0 = time.thread_time(), time.perf_counter()
        dst.copy_(src, non_blocking=True)
        cpu += time.thread_time() - c0
        wall_call += time.perf_counter() - w0
        stream.synchronize()
    total = time.perf_counter() - start
    return cpu / calls * 1e3, wall_call / calls * 1e3, total / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes-mb", default="0.004,0.3,1.2,4.9")
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(f"confidential computing: {confidential_state()}")
    print(f"{'source':42} {'MB':>6} {'call CPU ms':>12} {'call wall ms':>13} {'to end ms':>10} {'GB/s':>7}")
    for mb in (float(s) for s in args.sizes_mb.split(",")):
        nbytes = int(mb * 1e6)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        kinds, unregister = sources(nbytes)
        for label, src in kinds:
            cpu, call, end = measure(dst, src, args.calls)
            print(f"{label:42} {mb:6.3f} {cpu:12.4f} {call:13.4f} {end:10.4f} {nbytes / end / 1e6:7.1f}")
        torch.cuda.synchronize()
        unregister()
        d2d = torch.empty_like(dst)
        cpu, call, end = measure(d2d, dst, args.calls)
        print(f"{'device to device':42} {mb:6.3f} {cpu:12.4f} {call:13.4f} {end:10.4f} {nbytes / end / 1e6:7.1f}")
    waits(args.calls)


def waits(calls: int, spin_ms: float = 1.0) -> None:
    """Thread CPU and lateness of three ways to wait for ``spin_ms`` of device work."""
    cycles = int(spin_ms * 1e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    print(f"\nwaiting for {spin_ms} ms of device work (torch.cuda._sleep), {calls} times each:")
    print(f"{'how':34} {'thread CPU ms':>14} {'wall ms':>8}")
    for label, blocking, poll in (("poll event.query() (the engine)", False, True),
                                  ("event.synchronize(), default event", False, False),
                                  ("event.synchronize(), blocking event", True, False)):
        cpu = wall = 0.0
        for _ in range(calls):
            torch.cuda.synchronize()
            event = torch.cuda.Event(blocking=blocking)
            torch.cuda._sleep(cycles)
            event.record()
            w0, c0 = time.perf_counter(), time.thread_time()
            if poll:
                while not event.query():
                    pass
            else:
                event.synchronize()
            cpu += time.thread_time() - c0
            wall += time.perf_counter() - w0
        print(f"{label:34} {cpu / calls * 1e3:14.3f} {wall / calls * 1e3:8.3f}")


if __name__ == "__main__":
    main()
