"""`make loadtest`: train and export the demo model (once), start `recserve serve`, run the locust
load test headless for a fixed time, write locust's HTML report and CSV files, stop the server.

    python loadtest/run.py [--out build/loadtest] [--users 8] [--duration 20s] [--batch-size 64]
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.served import ServerProcess  # noqa: E402
from recserve.errors import UserError  # noqa: E402
from recserve.local import free_port  # noqa: E402


def ensure_artifact(out: Path) -> Path:
    repo = out / "repo"
    if not (repo / "demo").exists():
        ckpt = out / "checkpoint"
        for args in (["train-demo", "--out", str(ckpt), "--force"],  # its own work folder
                     ["export", "--checkpoint", str(ckpt), "--repo", str(repo), "--name", "demo", "--no-progress"]):
            subprocess.run([sys.executable, "-m", "recserve", "--log-level", "WARNING", *args], check=True, cwd=ROOT)
    return repo


def _refuse(parser: argparse.ArgumentParser, line: str) -> int:
    print(f"{parser.prog}: error: {line}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="loadtest/run.py", description=__doc__)
    p.add_argument("--out", type=Path, default=ROOT / "build" / "loadtest")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--duration", default="20s", help="locust --run-time")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--ids-per-bag", type=float, default=3.0)
    p.add_argument("--shared-features", default="", help="see locustfile.py")
    p.add_argument("--device", default="cpu", choices=["auto", "cuda", "cpu"])
    args = p.parse_args(argv)
    for flag, value in (("--users", args.users), ("--batch-size", args.batch_size)):
        if value < 1:  # no request at all (a success of 0 requests), or only refused ones
            return _refuse(p, f"{flag} must be >= 1, got {value}")
    if not 0 <= args.ids_per_bag < float("inf"):
        return _refuse(p, f"--ids-per-bag must be >= 0 (a mean number of ids), got {args.ids_per_bag:g}")
    args.out.mkdir(parents=True, exist_ok=True)
    repo = ensure_artifact(args.out)
    summary = args.out / "locust_final.json"
    summary.unlink(missing_ok=True)
    try:
        server = ServerProcess(repo, args.device, max_batch_size=4096, max_delay_ms=2.0, metrics_port=free_port())
    except UserError as e:  # the server refused what it was given (--device cuda without a GPU)
        return _refuse(p, str(e))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
             "--users", str(args.users), "--spawn-rate", str(args.users), "--run-time", args.duration,
             "--host", server.target, "--model", "demo", "--batch-size", str(args.batch_size),
             "--ids-per-bag", str(args.ids_per_bag), "--csv", str(args.out / "locust"),
             *(["--shared-features", args.shared_features] if args.shared_features else []),
             "--html", str(args.out / "report.html"), "--only-summary", "--stop-timeout", "10",
             "--summary-json", str(summary)],
            cwd=ROOT)
    finally:
        code = server.stop()
    # Locust's final totals, written when it quit: its CSV is a snapshot from a few seconds earlier.
    if not summary.exists():  # it never ran (a bad option, e.g. --duration): its own error is above
        print(f"locust exited with code {proc.returncode} before writing its totals; server exit code {code}",
              file=sys.stderr)
        return proc.returncode or 1
    total = json.loads(summary.read_text())
    print(f"\n{total['requests']} requests, {total['failures']} failures, "
          f"{total['requests_per_s']:.1f} requests/s, p50 {total['p50_ms']} ms, p99 {total['p99_ms']} ms; "
          f"report: {args.out / 'report.html'}, CSV: {args.out}/locust_*.csv; server exit code {code}")
    return 1 if proc.returncode or total["failures"] or code else 0


if __name__ == "__main__":
    sys.exit(main())
