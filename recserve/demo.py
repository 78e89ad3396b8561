"""``make demo``: train a tiny model, export it, serve it, query it, stop it - as a user would,
through the ``recserve`` command and the client library."""
from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from recserve.client import Client
from recserve.local import wait_serving


def _run(*args: str) -> None:
    print(f"\n$ recserve {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "recserve", *args], check=True)


def slice_samples(lengths: torch.Tensor, values: torch.Tensor, num_features: int, start: int, stop: int):
    """Samples [start, stop) of a key-major KJT, as (lengths [T*b], values)."""
    per_key = lengths.reshape(num_features, -1).numpy()
    key_starts = np.concatenate(([0], np.cumsum(per_key.sum(axis=1))))[:-1]
    sample_starts = np.concatenate([np.zeros((num_features, 1), np.int64), np.cumsum(per_key, axis=1)], axis=1)
    vals = [values.numpy()[key_starts[k] + sample_starts[k, start]: key_starts[k] + sample_starts[k, stop]]
            for k in range(num_features)]
    return per_key[:, start:stop].reshape(-1), np.concatenate(vals)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m recserve.demo", description=__doc__)
    parser.add_argument("--workdir", type=Path, default=Path("build/demo"))
    parser.add_argument("--device", default="cpu", help="export and serve on cpu or cuda")
    args = parser.parse_args()
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    checkpoint, repo = work / "checkpoint", work / "repo"

    _run("train-demo", "--out", str(checkpoint))
    _run("export", "--checkpoint", str(checkpoint), "--repo", str(repo), "--name", "demo", "--device", args.device)
    _run("inspect", str(repo / "demo" / "1"))

    print(f"\n$ recserve serve --repo {repo} --port 0 --metrics-port 0 --device {args.device}", flush=True)
    server = subprocess.Popen(
        [sys.executable, "-m", "recserve", "serve", "--repo", str(repo), "--port", "0", "--metrics-port", "0",
         "--device", args.device, "--poll-interval", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    target = None
    for line in server.stdout:
        print("  [server] " + line.rstrip(), flush=True)
        m = re.search(r"listening on ([\d.]+:\d+)", line)
        if m:
            target = m.group(1)
            break
    if target is None:
        print("server did not start", file=sys.stderr)
        return 1
    echo = threading.Thread(target=lambda: [print("  [server] " + line.rstrip(), flush=True) for line in server.stdout],
                            daemon=True)
    echo.start()
    # It listens at once and serves once the model is verified (health SERVING).
    if not wait_serving(target, 600, lambda: server.poll() is None):
        server.kill()
        print("server did not load the model", file=sys.stderr)
        return 1
    try:
        holdout = torch.load(checkpoint / "holdout.pt", weights_only=False)
        names = holdout["feature_names"]
        t = len(names)
        batch, n = 64, 4096
        scores, latencies, lookup_latencies = [], [], []
        with Client(target) as client:
            for start in range(0, n, batch):
                lengths, values = slice_samples(holdout["lengths"], holdout["values"], t, start, start + batch)
                began = time.perf_counter()
                scores.append(client.predict("demo", holdout["dense"][start:start + batch].numpy(),
                                             (names, lengths, values)))
                latencies.append(time.perf_counter() - began)
                began = time.perf_counter()
                client.lookup("demo", (names, lengths, values))
                lookup_latencies.append(time.perf_counter() - began)
        scores = np.concatenate(scores)
        labels = holdout["labels"][:n].numpy()
        print("\nPredictions for the first held-out samples (served):")
        for i in range(5):
            print(f"  sample {i}: ctr {scores[i]:.4f}  clicked {int(labels[i])}")
        from export.train_demo import auc  # the same AUC that train-demo reports

        print(f"\nServed held-out AUC over {n} samples: {auc(scores, labels):.4f}")
        for name, lat in (("Predict", latencies), ("Lookup", lookup_latencies)):
            ms = np.array(lat) * 1000
            print(f"{name:8s} {len(ms)} requests of {batch} samples: p50 {np.percentile(ms, 50):.2f} ms, "
                  f"p90 {np.percentile(ms, 90):.2f} ms, p99 {np.percentile(ms, 99):.2f} ms")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        echo.join(10)
    print(f"\nserver exited with code {server.returncode}")
    return server.returncode


if __name__ == "__main__":
    sys.exit(main())
