"""The floor: what the Python gRPC transport alone costs. A grpc.aio server takes each Predict
request as raw bytes (nothing decoded) and answers one constant, pre-serialized PredictResponse of
the right size (a float32 ctr of B values). It runs as N processes on one port (SO_REUSEPORT), N the
served server's front-end count, and the bench drives it with the same client processes and request
bytes as the served model: served p50 - (floor p50 + bare p50) is what the server adds beyond the
transport and the model call.

    python -m bench.floor --batch-size B [--port 0] [--processes N] [--host 127.0.0.1] [--model NAME]
    python -m bench.floor --batch-size B --oip-proxy HOST:PORT --model NAME [...]

With ``--oip-proxy`` it is the floor of the Open Inference Protocol instead, for perf_analyzer and
tritonclient: ModelInfer takes the request as raw bytes and answers one constant ModelInferResponse
(output "ctr", FP32 [B] in raw_output_contents); every other RPC of inference.GRPCInferenceService
(ModelMetadata, ModelConfig, ModelStatistics, ...) is passed as bytes to the served server at
HOST:PORT, so a client's set-up sees the real model.

Either prints ``bench.floor: listening on HOST:PORT (N processes)`` once every process answers;
SIGTERM or SIGINT stops them all, exit code 0.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import signal
import sys
import time

from recserve.local import ListeningProcess, free_port

SERVICE = "recserve.v1.Inference"
OIP_SERVICE = "inference.GRPCInferenceService"
MAX_MESSAGE_BYTES = 1 << 30  # as large as the bench's server accepts (serve --max-message-mb 1024)
READY_TIMEOUT_S = 120


def predict_response(batch_size: int, model: str = "", version: int = 0) -> bytes:
    import numpy as np

    from recserve import wire
    from recserve.v1 import inference_pb2 as pb

    ctr = np.full(batch_size, 0.5, dtype=np.float32)
    return pb.PredictResponse(ctr=wire.encode(ctr), model_name=model, model_version=version).SerializeToString()


def infer_response(batch_size: int, model: str, version: int) -> bytes:
    """The OIP floor's constant answer: what the served server answers a ctr-only ModelInfer."""
    import numpy as np

    from recserve.oip import grpc_predict_v2_pb2 as oip

    ctr = np.full(batch_size, 0.5, dtype="<f4")
    return oip.ModelInferResponse(
        model_name=model, model_version=str(version),
        outputs=[oip.ModelInferResponse.InferOutputTensor(name="ctr", datatype="FP32", shape=[batch_size])],
        raw_output_contents=[ctr.tobytes()]).SerializeToString()


def served_version(target: str, model: str) -> int:
    """The newest version of ``model`` that the OIP server at ``target`` has loaded."""
    import grpc

    from recserve.oip import grpc_predict_v2_pb2 as oip
    from recserve.oip.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub

    with grpc.insecure_channel(target) as channel:
        metadata = GRPCInferenceServiceStub(channel).ModelMetadata(oip.ModelMetadataRequest(name=model), timeout=30)
    return max(int(v) for v in metadata.versions)


class _OipFloor:
    """grpc's generic handler for the OIP floor: ModelInfer answered at once, the rest passed on."""

    def __init__(self, response: bytes, proxy: str) -> None:
        import grpc

        self.response, self.channel = response, grpc.aio.insecure_channel(
            proxy, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])

    def service(self, details):
        import grpc

        prefix = f"/{OIP_SERVICE}/"
        if not details.method.startswith(prefix):
            return None
        if details.method == prefix + "ModelInfer":
            async def infer(request: bytes, context) -> bytes:
                return self.response
            return grpc.unary_unary_rpc_method_handler(infer)
        forward = self.channel.unary_unary(details.method)  # bytes in, bytes out

        async def passed(request: bytes, context) -> bytes:
            try:
                return await forward(request, timeout=30)
            except grpc.aio.AioRpcError as e:  # the server's status, as it gave it
                await context.abort(e.code(), e.details() or "")
        return grpc.unary_unary_rpc_method_handler(passed)


async def _serve(host: str, port: int, response: bytes, reuse_port: bool, ready: "mp.Queue",
                 proxy: str = "") -> None:
    import grpc

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def predict(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return response

    # The served server's options, so that both pay for the same transport.
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", int(reuse_port))])
    if proxy:
        server.add_generic_rpc_handlers((_OipFloor(response, proxy),))
    else:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {"Predict": grpc.unary_unary_rpc_method_handler(predict)}),))  # no (de)serializer: bytes
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    ready.put(bound)
    await stop.wait()
    await server.stop(1.0)


def _process(host: str, port: int, response: bytes, reuse_port: bool, ready: "mp.Queue", proxy: str) -> None:
    asyncio.run(_serve(host, port, response, reuse_port, ready, proxy))


def serve_floor(batch_size: int, host: str = "127.0.0.1", port: int = 0, processes: int = 1, model: str = "",
                version: int = 0, oip_proxy: str = "") -> int:
    """Run ``processes`` floor servers on one port until SIGTERM/SIGINT; the first non-zero exit
    code among them, else 0. When one exits on its own, the others are stopped too. ``oip_proxy``:
    the OIP floor, passing what is not ModelInfer to that server."""
    if processes > 1 and port == 0:
        port = free_port(host)  # every process must bind the same one
    if oip_proxy and not version:  # perf_analyzer looks the answer's version up in the server's statistics
        version = served_version(oip_proxy, model)
    response = (infer_response if oip_proxy else predict_response)(batch_size, model, version)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    procs = [ctx.Process(target=_process, args=(host, port, response, processes > 1, ready, oip_proxy),
                         name=f"floor-{i}") for i in range(processes)]

    stopping = []

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for p in procs:
        p.start()
    bound = []
    while len(bound) < processes and all(p.exitcode is None for p in procs):
        try:
            bound.append(ready.get(timeout=0.2))
        except queue.Empty:
            pass
    if len(bound) == processes:
        print(f"bench.floor: listening on {host}:{bound[0]} ({processes} processes)", flush=True)
    while all(p.exitcode is None for p in procs):
        time.sleep(0.2)
    if not stopping:  # one exited on its own: stop the others (a second SIGTERM could kill one mid-shutdown)
        forward(signal.SIGTERM, None)
    for p in procs:
        p.join()
    return next((p.exitcode for p in procs if p.exitcode), 0)


class FloorProcess(ListeningProcess):
    """``python -m bench.floor`` as the bench starts it, for one batch size."""

    def __init__(self, batch_size: int, processes: int, model: str = "", version: int = 0, oip_proxy: str = "") -> None:
        super().__init__([sys.executable, "-m", "bench.floor", "--batch-size", str(batch_size), "--processes",
                          str(processes), "--model", model, "--version", str(version)]
                         + (["--oip-proxy", oip_proxy] if oip_proxy else []),
                         READY_TIMEOUT_S, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, required=True, help="ctr values in every answer")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    p.add_argument("--processes", type=int, default=1, help="server processes sharing the port")
    p.add_argument("--model", default="", help="model_name in the answers (their size, as served)")
    p.add_argument("--version", type=int, default=0,
                   help="model_version in the answers (with --oip-proxy, 0: the server's newest)")
    p.add_argument("--oip-proxy", default="", metavar="HOST:PORT",
                   help="the OIP floor: RPCs other than ModelInfer go to this server")
    args = p.parse_args()
    if args.batch_size < 1 or args.processes < 1:
        p.error("--batch-size and --processes must be >= 1")
    if args.oip_proxy and not args.model:
        p.error("--oip-proxy needs --model (the model the served server holds)")
    if args.oip_proxy and not args.version:
        import grpc

        try:
            args.version = served_version(args.oip_proxy, args.model)
        except grpc.RpcError as e:
            print(f"bench.floor: the OIP server at {args.oip_proxy} did not give model {args.model!r}'s versions "
                  f"({e.code().name}: {e.details()}); start it (recserve serve) or fix --oip-proxy/--model",
                  file=sys.stderr)
            return 2
    return serve_floor(args.batch_size, args.host, args.port, args.processes, args.model, args.version,
                       args.oip_proxy)


if __name__ == "__main__":
    sys.exit(main())
