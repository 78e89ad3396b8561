"""How long a front end's event loop stops for one JSON inference body (HTTP/REST without Triton's
binary tensor extension), on this machine's CPU: the body is parsed (``json.loads``) and its data made
arrays (``serving/frontend/oip/jsonwire.py``) in the loop's thread, and while that runs no other
request of that front end moves, gRPC and health checks included. Also run in a thread
(``asyncio.to_thread``): json.loads holds the GIL throughout, so the loop stops as long.

    python -m bench.json_body [--mib 1,4,16,64] [--repeats 3]

prints one row per body size: the parse alone, the whole decode, and the loop's longest stall with
the parse in a thread (each the median of --repeats, in ms). The body is a ranking request as a
client writes it with json.dumps: dense [B, 13] FP32, and 26 features packed (lengths [26, B], ids
INT64, 10 per bag), B grown until the body has the size asked for.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from typing import Callable, List

import numpy as np

from serving.frontend.oip import jsonwire

DENSE, FEATURES, IDS_PER_BAG = 13, 26, 10


def body(mib: float, seed: int = 0) -> bytes:
    """A JSON inference body of about ``mib`` MiB (within 1%)."""
    rng = np.random.default_rng(seed)

    def of(b: int) -> bytes:
        lengths = np.full((FEATURES, b), IDS_PER_BAG, np.int64)
        return json.dumps({"inputs": [
            {"name": "dense", "datatype": "FP32", "shape": [b, DENSE],
             "data": rng.random(b * DENSE, np.float32).tolist()},
            {"name": "lengths", "datatype": "INT32", "shape": [FEATURES, b], "data": lengths.ravel().tolist()},
            {"name": "ids", "datatype": "INT64", "shape": [int(lengths.sum())],
             "data": rng.integers(0, 10**6, int(lengths.sum())).tolist()}]}).encode()

    b = 64
    sample = of(b)
    b = max(1, int(b * mib * 2**20 / len(sample)))
    return of(b)


def _median_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def decode(raw: bytes) -> None:
    """What a front end does with the body before the engine: jsonwire's parse and arrays."""
    request = jsonwire.parse_infer(raw, None)
    expected = {"dense": (("float32",), 2, 1 << 40), "lengths": (("int32", "int64"), 2, 1 << 40),
                "ids": (("int64", "int32"), 1, 1 << 40)}
    jsonwire.arrays(request, expected)


async def _stall_in_thread(raw: bytes) -> float:
    """The loop's longest stall (s) while json.loads runs in another thread."""
    loop = asyncio.get_running_loop()
    lags: List[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        while not done.is_set():
            began = loop.time()
            await asyncio.sleep(0.001)
            lags.append(loop.time() - began - 0.001)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    await asyncio.to_thread(json.loads, raw)
    done.set()
    await ticker
    return max(lags)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.json_body", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", default="1,4,16,64", help="body sizes, MiB")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(f"{'body MiB':>8} {'json.loads ms':>13} {'decode ms':>9} {'MiB/s':>6} {'stall, parse in a thread ms':>27}")
    for mib in (float(m) for m in args.mib.split(",")):
        raw = body(mib)
        parse = _median_ms(lambda: json.loads(raw), args.repeats)
        whole = _median_ms(lambda: decode(raw), args.repeats)
        stall = 1e3 * statistics.median(asyncio.run(_stall_in_thread(raw)) for _ in range(args.repeats))
        print(f"{len(raw) / 2**20:8.1f} {parse:13.0f} {whole:9.0f} {len(raw) / 2**20 / whole * 1e3:6.0f} {stall:27.0f}")


if __name__ == "__main__":
    main()
