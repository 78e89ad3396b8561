"""The gRPC servicer: request bytes <-> arrays and nothing else. The request path is
protowire (locate fields) -> validate (arrays, checked) -> engine (serving/frontend/link.py ``EngineLink``:
shared buffer, batched model call in the engine process) -> protowire (response bytes). Errors become
status codes, and requests are counted, in serving/frontend/status.py ``grpc_errors``."""
from __future__ import annotations

import time
from typing import Optional

import grpc

from recserve.v1 import inference_pb2 as pb
from serving.frontend import protowire
from serving.errors import InvalidInput
from serving.frontend.link import resolve_version
from serving.frontend.status import Call, grpc_errors
from serving.frontend.validate import decode_lookup, decode_predict


def pinned(request: protowire.RawRequest) -> bool:
    """Did the client name the version (a number or a label)? Then only that version may answer."""
    return request.model_version != 0 or bool(request.model_version_label)


def deadline(context: grpc.aio.ServicerContext) -> Optional[float]:
    """The call's deadline as time.monotonic() (the engine's clock), None without one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class InferenceServicer:
    def __init__(self, engine, metrics) -> None:
        self.engine = engine  # serving.frontend.link.EngineLink
        self.metrics = metrics

    @grpc_errors("Predict")
    async def Predict(self, body: bytes, context, call: Call) -> bytes:
        with call.step("decode"):
            request = protowire.parse_request(body, predict=True)
            model = self.engine.model(request.model_name, request.model_version, request.model_version_label)
            call.model, call.version = request.model_name, str(model.version)
            dense, sparse = decode_predict(body, request, model.schema)
            call.batch_size = sparse.batch_size
        async with self.engine.run("Predict", model, sparse, dense, pinned(request), deadline(context),
                                   call) as (version, ctr):
            call.version = str(version)
            with call.step("encode"):
                return protowire.predict_response(ctr, sparse.batch_size, request.model_name, version)

    @grpc_errors("Lookup")
    async def Lookup(self, body: bytes, context, call: Call) -> bytes:
        with call.step("decode"):
            request = protowire.parse_request(body, predict=False)
            model = self.engine.model(request.model_name, request.model_version, request.model_version_label)
            call.model, call.version = request.model_name, str(model.version)
            sparse = decode_lookup(body, request, model.schema)
            call.batch_size = sparse.batch_size
            dims = [model.schema.dims[p] for p in sparse.all_positions]
        async with self.engine.run("Lookup", model, sparse, None, pinned(request), deadline(context),
                                   call) as (version, pooled):
            call.version = str(version)
            with call.step("encode"):
                return protowire.lookup_response(sparse.all_keys, dims, pooled, sparse.batch_size, request.model_name,
                                                 version)

    @grpc_errors("GetModelInfo")
    async def GetModelInfo(self, body: bytes, context, call: Call) -> bytes:
        try:
            request = pb.GetModelInfoRequest.FromString(body)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends: the body is not the message
            raise InvalidInput("the request body is not a valid recserve.v1.GetModelInfoRequest") from None
        name, version, label = request.model_name, request.model_version, request.model_version_label
        if not name and (version or label):
            raise InvalidInput("a model version or version label needs the model's name")
        names = [name] if name else sorted(self.engine.models)
        infos = []
        for n in names:
            model = self.engine.known(n)
            infos.append(model.infos[resolve_version(model, version, label).version])
            call.model = n
        return protowire.model_info_response(infos)


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Register the Inference service with raw-bytes handlers: each method reads the protobuf wire
    format itself (serving/frontend/protowire.py), so undecodable bytes become INVALID_ARGUMENT, not UNKNOWN."""
    service = pb.DESCRIPTOR.services_by_name["Inference"]
    handlers = {m.name: grpc.unary_unary_rpc_method_handler(getattr(servicer, m.name)) for m in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
