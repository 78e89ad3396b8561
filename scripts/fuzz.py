"""The long fuzz run: >= 50,000 seeded cases against `recserve serve` with the default limits.

    python scripts/fuzz.py [--cases 50000] [--seed 0] [--device cpu]

The cases of tests/test_fuzz.py (tests/fuzzing.py): recserve.v1 and OIP requests (raw and typed,
shared features) checked against the float reference model, cancellations at random moments,
garbage, and a broken version in the repository every 250 cases. Exits non-zero if a case got a
status code outside the documented set or a wrong answer, a good request was answered differently
afterwards, a process of the server died, fewer than 30% of the cases were answered OK, or the
server did not exit 0 on SIGTERM. Prints the codes seen.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fuzzing import REPOSITORY_FAULTS, Fuzzer, Oracle, cases, good_request, publish_fault  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402

from recserve.client import Client  # noqa: E402
from recserve.local import ListeningProcess, free_port, samples, scrape, wait_serving  # noqa: E402

REPOSITORY_EVERY = 250


def refusals(metrics_port: int) -> float:
    return sum(s.value for s in samples(scrape(metrics_port), "recserve_model_load_failures_total", model="demo"))


def wait(predicate, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/fuzz.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=50_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "fuzz")
    args = p.parse_args(argv)
    if args.cases < 1:  # hypothesis's InvalidArgument traceback, after the training, export and server start
        print(f"{p.prog}: error: --cases must be >= 1, got {args.cases}", file=sys.stderr)
        return 2
    ckpt, source, repo = args.work / "ckpt", args.work / "artifact", args.work / "repo"
    if not (source / "demo" / "1").exists():
        for cmd in (["train-demo", "--out", str(ckpt), "--steps", "100", "--force"],  # its own work folder
                    ["export", "--checkpoint", str(ckpt), "--repo", str(source), "--name", "demo",
                     "--device", args.device, "--no-progress"]):
            subprocess.run([sys.executable, "-m", "recserve", "--log-level", "WARNING", *cmd], check=True, cwd=ROOT)
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(source / "demo" / "1", repo / "demo" / "1")
    metrics_port = free_port()
    server = ListeningProcess([sys.executable, "-m", "recserve", "--log-level", "WARNING", "serve", "--repo",
                               str(repo), "--port", "0", "--device", args.device, "--metrics-port", str(metrics_port),
                               "--poll-interval", "0.2"], 120, env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=str(ROOT))
    faults, count, started = sorted(REPOSITORY_FAULTS), [0], time.time()
    try:
        assert wait_serving(server.target, 120, server.alive), "".join(server.lines[-30:])
        with Client(server.target) as client:
            oracle = Oracle(ckpt, client.model_info("demo").models[0])
            send = good_request(oracle)
            fuzzer = Fuzzer(client.channel, oracle, (send, send(client.channel)["ctr"]))

            @hypothesis_seed(args.seed)
            @settings(max_examples=args.cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(cases())
            def case(item):
                count[0] += 1
                if count[0] % REPOSITORY_EVERY == 0:
                    before = refusals(metrics_port)
                    path = publish_fault(repo, source / "demo" / "1", 2, faults[(count[0] // REPOSITORY_EVERY) % len(faults)])
                    assert wait(lambda: refusals(metrics_port) > before), path
                    assert [v.version for v in client.model_info("demo").models[0].versions] == [1]
                    path.unlink() if path.is_symlink() else shutil.rmtree(path)
                fuzzer.run(item)
                if count[0] % 1000 == 0:
                    print(f"  {count[0]} cases, {time.time() - started:.0f}s: {fuzzer.seen}", flush=True)
                assert server.proc.poll() is None, "the server died"

            case()
        internal = sum(s.value for s in samples(scrape(metrics_port), "recserve_requests_total", code="INTERNAL"))
        # No slot leaked, whatever ended each case: the front ends' buffers empty once answers are in.
        leaked = None
        if not wait(lambda: sum(s.value for s in samples(scrape(metrics_port),
                                                         "recserve_frontend_buffer_used_bytes")) == 0):
            leaked = sum(s.value for s in samples(scrape(metrics_port), "recserve_frontend_buffer_used_bytes"))
    finally:
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
    seen = fuzzer.seen
    total, ok = sum(seen.values()), seen.get("OK", 0)
    print(f"{total} cases in {time.time() - started:.0f}s: {seen}; OK {ok / max(total, 1):.0%}; INTERNAL "
          f"{internal:.0f}; buffer bytes leaked {leaked or 0:.0f}; server exit code {code}")
    return 0 if total >= args.cases and ok >= 0.3 * total and internal == 0 and not leaked and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
