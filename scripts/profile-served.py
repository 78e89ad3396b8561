"""Profile `recserve serve` under closed-loop load: py-spy records the engine and one front end while
the bench's clients drive the server. Raw stacks (py-spy --format raw) go to OUT; summarise them with
`python scripts/profile-served.py --summarise FILE`. Prints the CPU seconds of each of the engine's
threads over the profiled window; --native adds C and C++ frames (the process pauses per sample).
  usage: python scripts/profile-served.py --repo R --name N --device cuda --batch-size 1024 --clients 16
"""
import argparse
import collections
import os
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def summarise(path: str, top: int = 25) -> None:
    """Self time and inclusive time per function from py-spy's raw (collapsed) stacks."""
    own, total, samples = collections.Counter(), collections.Counter(), 0
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        samples += n
        own[frames[-1]] += n
        for f in set(frames):
            total[f] += n
    print(f"{path}: {samples} samples")
    print("  self:")
    for f, n in own.most_common(top):
        print(f"    {100 * n / samples:5.1f}%  {f[:150]}")
    print("  inclusive:")
    for f, n in total.most_common(top):
        print(f"    {100 * n / samples:5.1f}%  {f[:150]}")


def thread_cpu(pid: int) -> dict:
    """{thread id: (name, CPU seconds so far)} of a process (Linux /proc)."""
    ticks, out = os.sysconf("SC_CLK_TCK"), {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
            out[task.name] = (name, (int(fields[11]) + int(fields[12])) / ticks)  # utime + stime
        except (OSError, IndexError, ValueError):
            continue
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repo", type=Path)
    p.add_argument("--name")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--frontends", type=int, default=8)
    p.add_argument("--seconds", type=float, default=8)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    p.add_argument("--native", action="store_true", help="C and C++ frames too (py-spy pauses the process per sample)")
    p.add_argument("--summarise", default="")
    args = p.parse_args()
    if args.summarise:
        for f in args.summarise.split(","):
            summarise(f)
        return 0
    import psutil

    from bench.clients import RequestShape, closed_loop
    from bench.served import ServerProcess, model_info
    from recserve.local import free_port

    server = ServerProcess(args.repo, args.device, max_batch_size=args.batch_size, max_delay_ms=0,
                           metrics_port=free_port(), frontends=args.frontends)
    try:
        children = psutil.Process(server.proc.pid).children()
        # The engine is the child that loaded torch; front ends never import it.
        engine = [c for c in children if any("libtorch" in m.path for m in c.memory_maps())]
        # The front ends: the other spawned children (not multiprocessing's resource tracker).
        fronts = [c for c in children if c not in engine and "spawn_main" in " ".join(c.cmdline())]
        info = model_info(server.target, args.name)
        load = threading.Thread(target=lambda: print(closed_loop("served", server.target, info, args.batch_size,
                                                                  args.clients, args.seconds + 4,
                                                                  RequestShape(10.0))))
        load.start()
        import time

        time.sleep(3)
        spies = [subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "--duration", str(int(args.seconds)),
                                   "--rate", "500", "--format", "raw",
                                   "--native" if args.native else "--nonblocking", "--threads", "-o",
                                   str(args.out / f"{label}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                 for label, proc in (("engine", engine[0]), ("frontend", fronts[0]))]
        before = thread_cpu(engine[0].pid)
        for s in spies:
            s.wait()
        after = thread_cpu(engine[0].pid)
        load.join()
        busy = sorted(((after[t][1] - before.get(t, (None, 0.0))[1], after[t][0]) for t in after), reverse=True)
        print(f"engine threads, CPU seconds over the {args.seconds:.0f} s profiled: "
              + ", ".join(f"{name} {cpu:.2f}" for cpu, name in busy[:6]))
    finally:
        server.stop()
    for label in ("engine", "frontend"):
        summarise(str(args.out / f"{label}.txt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
