"""Does gRPC's HTTP/2 flow control or frame size limit large requests? One unary call at a time
over loopback, a request of each size and a 16-byte answer, against a grpc.aio server (in its own
process, as a front end is) started with gRPC's defaults and with larger windows or frames. The
client is a plain grpc channel in this process; the server does nothing but answer.

    python -m bench.transport [--sizes 300000,4900000] [--calls 200] [--rounds 2]

prints one row per (server settings, size, round): p50 and mean ms per call, and the payload's
rate at the p50.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from typing import Dict, List, Tuple

MiB = 1 << 20
SETTINGS: Dict[str, List[Tuple[str, int]]] = {
    "gRPC defaults": [],
    "window 16 MiB": [("grpc.http2.lookahead_bytes", 16 * MiB)],  # the stream's initial flow-control window
    "frames 16 MiB": [("grpc.http2.max_frame_size", 16 * MiB - 1)],  # the largest HTTP/2 frame it accepts
    "both": [("grpc.http2.lookahead_bytes", 16 * MiB), ("grpc.http2.max_frame_size", 16 * MiB - 1)],
}


def _serve(options: List[Tuple[str, int]], ports: "mp.Queue") -> None:
    import grpc

    async def answer(body: bytes, context) -> bytes:
        return b"x" * 16

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 * MiB), *options])
        handler = grpc.unary_unary_rpc_method_handler(answer)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe.Transport", {"Call": handler}),))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def measure(options: List[Tuple[str, int]], size: int, calls: int) -> List[float]:
    """Seconds per call, after 20 unmeasured calls on the same channel."""
    import grpc

    ports: "mp.Queue" = mp.get_context("spawn").Queue()
    server = mp.get_context("spawn").Process(target=_serve, args=(options, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 256 * MiB)]) as ch:
            call = ch.unary_unary("/probe.Transport/Call")
            payload = bytes(size)
            for _ in range(20):
                call(payload, timeout=30)
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                call(payload, timeout=30)
                times.append(time.perf_counter() - start)
            return times
    finally:
        server.terminate()
        server.join(10)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="300000,4900000", help="request bytes, comma-separated")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2, help="every setting once per round, in turn")
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes: comma-separated integers, got {args.sizes!r}")
    if min(sizes) < 1 or args.calls < 1 or args.rounds < 1:
        p.error("--sizes, --calls and --rounds must be >= 1")
    print(f"{'server settings':<16} {'bytes':>10} {'round':>5} {'p50 ms':>8} {'mean ms':>8} {'GB/s at p50':>11}")
    for size in sizes:
        for r in range(args.rounds):
            for name, options in SETTINGS.items():
                times = measure(options, size, args.calls)
                p50 = statistics.median(times)
                print(f"{name:<16} {size:>10} {r + 1:>5} {p50 * 1e3:>8.3f} {statistics.mean(times) * 1e3:>8.3f} "
                      f"{size / p50 / 1e9:>11.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
