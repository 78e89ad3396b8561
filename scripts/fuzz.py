"""The long fuzz run: >= 10,000 random and mutated requests against `recserve serve`.

    python scripts/fuzz.py [--cases 10000] [--device cpu]

Exits non-zero if any case got a status code outside the documented set, the server stopped being
SERVING, or a good request was answered differently afterwards. Prints the codes seen.
"""
import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402
from fuzzing import raw_calls, requests, send_case  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from bench.served import ServerProcess  # noqa: E402
from recserve.local import free_port, samples, scrape  # noqa: E402
from recserve.client import Client, random_request  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "fuzz")
    args = p.parse_args()
    repo = args.work / "repo"
    if not (repo / "demo").exists():
        for cmd in (["train-demo", "--out", str(args.work / "ckpt"), "--steps", "100"],
                    ["export", "--checkpoint", str(args.work / "ckpt"), "--repo", str(repo), "--name", "demo",
                     "--device", args.device, "--no-progress"]):
            subprocess.run([sys.executable, "-m", "recserve", "--log-level", "WARNING", *cmd], check=True, cwd=ROOT)
    server = ServerProcess(repo, args.device, max_batch_size=64, max_delay_ms=0, metrics_port=free_port())
    seen, started = {}, time.time()
    try:
        with Client(server.target) as client:
            info = client.model_info("demo").models[0]
            dense, sparse = random_request(info, 5, seed=11)
            before = client.predict("demo", dense, sparse)
            calls = raw_calls(client.channel)

            @settings(max_examples=args.cases, deadline=None, suppress_health_check=list(HealthCheck),
                      database=None)
            @given(requests())
            def case(item):
                send_case(calls, item, seen)
                if sum(seen.values()) % 1000 == 0:
                    print(f"  {sum(seen.values())} cases, {time.time() - started:.0f}s: {seen}", flush=True)

            case()
            same = np.array_equal(client.predict("demo", dense, sparse), before)
        internal = sum(s.value for s in samples(scrape(server.metrics_port), "recserve_requests_total",
                                                code="INTERNAL"))
    finally:
        code = server.stop()
    total = sum(seen.values())
    print(f"{total} cases in {time.time() - started:.0f}s: {seen}; INTERNAL {internal:.0f}; good request "
          f"answered {'the same' if same else 'DIFFERENTLY'} afterwards; server exit code {code}")
    return 0 if total >= args.cases and same and internal == 0 and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
