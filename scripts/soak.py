"""Soak: locust load for N minutes while a new model version is published every minute.

    python scripts/soak.py [--minutes 10] [--device cpu] [--users 8] [--publish-every 60]

Pass criteria: zero non-OK responses to the (valid) load, every published version served, the
engine's resident memory and GPU memory flat (least-squares slope after the first minute, printed in MiB per minute).
Writes build/soak/soak.json and locust's CSV/HTML there.
"""
import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.served import ServerProcess  # noqa: E402
from recserve.local import free_port, samples, scrape  # noqa: E402


def server_state(port: int) -> dict:
    """GPU memory, versions loaded, and resident memory of every process of the server
    (``rss_mib``: the engines', which hold the models; the supervisor is only their parent)."""
    text = scrape(port)
    gpu = sum(s.value for s in samples(text, "recserve_gpu_memory_bytes"))
    loaded = [s.labels["version"] for s in samples(text, "recserve_model_version_loaded") if s.value == 1]
    rss = {s.labels["process"]: s.value / 2**20 for s in samples(text, "process_resident_memory_bytes")}
    return {"gpu_mib": gpu / 2**20, "loaded": loaded, "rss_mib_by_process": rss,
            "rss_mib": sum(mib for process, mib in rss.items() if process.startswith("engine"))}


def slope(points):
    """Least-squares slope of (minutes, value) points."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/soak.py", description=__doc__)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--publish-every", type=float, default=60)
    p.add_argument("--out", type=Path, default=ROOT / "build" / "soak")
    args = p.parse_args(argv)
    # The memory slopes leave out the first minute: a run of a minute or less could end in a TypeError (no samples).
    for flag, wrong, rule in (("--minutes", not 1 < args.minutes < float("inf"), "more than 1 (the memory slopes "
                                                                                  "leave out the first minute)"),
                              ("--users", args.users < 1, ">= 1"), ("--batch-size", args.batch_size < 1, ">= 1"),
                              ("--publish-every", not 0 < args.publish_every < float("inf"), "> 0 seconds")):
        if wrong:
            print(f"{p.prog}: error: {flag} must be {rule}, got {getattr(args, flag[2:].replace('-', '_')):g}",
                  file=sys.stderr)
            return 2
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    ckpt, repo = out / "ckpt", out / "repo"
    run = lambda *a: subprocess.run([sys.executable, "-m", "recserve", "--log-level", "WARNING", *a], check=True,  # noqa: E731
                                    cwd=ROOT, stdout=subprocess.DEVNULL)
    if not (ckpt / "weights.pt").exists():
        run("train-demo", "--out", str(ckpt), "--steps", "200")
    if repo.exists():
        subprocess.run(["rm", "-rf", str(repo)], check=True)
    run("export", "--checkpoint", str(ckpt), "--repo", str(repo), "--name", "demo", "--device", args.device,
        "--no-progress")
    server = ServerProcess(repo, args.device, max_batch_size=4096, max_delay_ms=0, metrics_port=free_port(),
                           poll_interval=2.0)
    seconds = args.minutes * 60
    locust = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
         "--users", str(args.users), "--spawn-rate", str(args.users), "--run-time", f"{int(seconds)}s",
         "--host", server.target, "--model", "demo", "--batch-size", str(args.batch_size),
         "--csv", str(out / "locust"), "--html", str(out / "report.html"), "--only-summary"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    samples, published = [], [1]
    started = time.time()
    next_publish = started + args.publish_every
    try:
        while locust.poll() is None:
            now = time.time()
            if now >= next_publish and now - started < seconds - 10:
                run("export", "--checkpoint", str(ckpt), "--repo", str(repo), "--name", "demo", "--device",
                    args.device, "--no-progress")
                published.append(published[-1] + 1)
                next_publish += args.publish_every
                print(f"  {(now - started) / 60:5.1f} min: published version {published[-1]}", flush=True)
            m = server_state(server.metrics_port)
            samples.append({"minute": (time.time() - started) / 60, **m})
            time.sleep(5)
        time.sleep(3)
        final = server_state(server.metrics_port)
    finally:
        exit_code = server.stop()
    with open(out / "locust_stats.csv") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    total = stats["Aggregated"]
    steady = [s for s in samples if s["minute"] >= 1.0]
    result = {
        "minutes": args.minutes, "device": args.device, "users": args.users, "batch_size": args.batch_size,
        "requests": int(total["Request Count"]), "failures": int(total["Failure Count"]),
        "requests_per_s": float(total["Requests/s"]), "p50_ms": float(total["50%"]), "p99_ms": float(total["99%"]),
        "versions_published": published, "served_at_end": final["loaded"],
        "rss_mib_first": steady[0]["rss_mib"] if steady else None, "rss_mib_last": steady[-1]["rss_mib"] if steady else None,
        "rss_slope_mib_per_min": slope([(s["minute"], s["rss_mib"]) for s in steady]),
        "gpu_mib_last": steady[-1]["gpu_mib"] if steady else None,
        "gpu_slope_mib_per_min": slope([(s["minute"], s["gpu_mib"]) for s in steady]),
        "server_exit_code": exit_code, "samples": samples,
    }
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['requests']} requests, {result['failures']} failures, {result['requests_per_s']:.0f}/s, "
          f"p99 {result['p99_ms']} ms; versions published {published[-1]}, served at end {final['loaded']}; "
          f"engine RSS {result['rss_mib_first']:.0f} -> {result['rss_mib_last']:.0f} MiB, slope "
          f"{result['rss_slope_mib_per_min']:+.2f} MiB/min; GPU slope {result['gpu_slope_mib_per_min']:+.2f} MiB/min; "
          f"exit code {exit_code}")
    ok = result["failures"] == 0 and final["loaded"] == [str(published[-1])] and exit_code == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
