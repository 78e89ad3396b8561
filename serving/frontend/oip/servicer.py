"""The Open Inference Protocol over gRPC (KServe v2 / Triton gRPC, service
``inference.GRPCInferenceService``): protobuf <-> serving/frontend/oip/protocol.py, which HTTP/REST
(oip/rest.py) shares, and nothing else. Errors become status codes, and requests are counted, in
serving/frontend/status.py ``grpc_errors``. The tensor contract is documented in
protos/recserve/oip/grpc_predict_v2.proto."""
from __future__ import annotations

import grpc
from google.protobuf import json_format

from recserve.oip import grpc_predict_v2_pb2 as oip
from serving.errors import InvalidInput
from serving.frontend.oip import wire
from serving.frontend.oip.shm import NO_SHARED_MEMORY, SharedMemory
from serving.frontend.oip.protocol import PLATFORM, InferRequest, Oip, model_config, \
    model_metadata, request_options, server_version
from serving.frontend.servicer import deadline
from serving.frontend.status import Call, grpc_errors

SERVICE = oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


class OipServicer:
    def __init__(self, engine, metrics, model_control: str = "poll", shared: SharedMemory = NO_SHARED_MEMORY) -> None:
        self.oip = Oip(engine, model_control, shared)
        self.metrics = metrics

    @grpc_errors("ServerLive", SERVICE)
    async def ServerLive(self, body: bytes, context, call: Call) -> bytes:
        return oip.ServerLiveResponse(live=True).SerializeToString()

    @grpc_errors("ServerReady", SERVICE)
    async def ServerReady(self, body: bytes, context, call: Call) -> bytes:
        return oip.ServerReadyResponse(ready=self.oip.ready).SerializeToString()

    @grpc_errors("ServerMetadata", SERVICE)
    async def ServerMetadata(self, body: bytes, context, call: Call) -> bytes:
        return oip.ServerMetadataResponse(name=PLATFORM, version=server_version(),
                                          extensions=self.oip.extensions).SerializeToString()

    @grpc_errors("ModelReady", SERVICE)
    async def ModelReady(self, body: bytes, context, call: Call) -> bytes:
        request = _parse(oip.ModelReadyRequest, body)
        return oip.ModelReadyResponse(ready=self.oip.model_ready(request.name, request.version, call)).SerializeToString()

    @grpc_errors("ModelMetadata", SERVICE)
    async def ModelMetadata(self, body: bytes, context, call: Call) -> bytes:
        request = _parse(oip.ModelMetadataRequest, body)
        schema, versions = self.oip.model(request.name, request.version, call)
        metadata = model_metadata(request.name, versions, schema, self.oip.settings(request.name))
        return json_format.ParseDict(metadata, oip.ModelMetadataResponse()).SerializeToString()

    @grpc_errors("ModelConfig", SERVICE)
    async def ModelConfig(self, body: bytes, context, call: Call) -> bytes:
        request = _parse(oip.ModelConfigRequest, body)
        schema, _ = self.oip.model(request.name, request.version, call)
        config = json_format.ParseDict(model_config(request.name, schema, self.oip.settings(request.name)),
                                       oip.ModelConfig())
        return oip.ModelConfigResponse(config=config).SerializeToString()

    @grpc_errors("ModelStatistics", SERVICE)
    async def ModelStatistics(self, body: bytes, context, call: Call) -> bytes:
        request = _parse(oip.ModelStatisticsRequest, body)
        found = await self.oip.statistics(request.name, request.version, call)
        return json_format.ParseDict({"model_stats": found}, oip.ModelStatisticsResponse()).SerializeToString()

    @grpc_errors("RepositoryIndex", SERVICE)
    async def RepositoryIndex(self, body: bytes, context, call: Call) -> bytes:
        request = _parse(oip.RepositoryIndexRequest, body)
        index = self.oip.repository_index(request.repository_name, request.ready)
        return json_format.ParseDict({"models": index}, oip.RepositoryIndexResponse()).SerializeToString()

    @grpc_errors("RepositoryModelLoad", SERVICE)
    async def RepositoryModelLoad(self, body: bytes, context, call: Call) -> bytes:
        request = _parse(oip.RepositoryModelLoadRequest, body)
        await self.oip.control("load", request.repository_name, request.model_name, dict(request.parameters), call)
        return oip.RepositoryModelLoadResponse().SerializeToString()

    @grpc_errors("RepositoryModelUnload", SERVICE)
    async def RepositoryModelUnload(self, body: bytes, context, call: Call) -> bytes:
        request = _parse(oip.RepositoryModelUnloadRequest, body)
        await self.oip.control("unload", request.repository_name, request.model_name, dict(request.parameters), call)
        return oip.RepositoryModelUnloadResponse().SerializeToString()

    @grpc_errors("ModelInfer", SERVICE)
    async def ModelInfer(self, body: bytes, context, call: Call) -> bytes:
        with call.step("decode"):
            request = wire.parse_infer(body)
            only, until = request_options(request.parameters, deadline(context))
        try:
            version, outputs = await self.oip.infer(
                InferRequest(request.model_name, request.model_version, request.outputs, only,
                             lambda expected: wire.arrays(body, request, expected, self.oip.shared),
                             request.output_places), until, call)
            with call.step("encode"):
                return wire.infer_response(outputs, request.model_name, version, request.id, request.output_places,
                                           self.oip.shared)
        finally:  # the regions its outputs were checked against (oip/shm.py)
            self.oip.shared.release(request.output_places)

    @grpc_errors("SystemSharedMemoryStatus", SERVICE)
    async def SystemSharedMemoryStatus(self, body: bytes, context, call: Call) -> bytes:
        request = _parse(oip.SystemSharedMemoryStatusRequest, body)
        response = oip.SystemSharedMemoryStatusResponse()
        for r in self.oip.shared.status(request.name):
            response.regions[r.name].CopyFrom(oip.SystemSharedMemoryStatusResponse.RegionStatus(
                name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size))
        return response.SerializeToString()

    @grpc_errors("SystemSharedMemoryRegister", SERVICE)
    async def SystemSharedMemoryRegister(self, body: bytes, context, call: Call) -> bytes:
        request = _parse(oip.SystemSharedMemoryRegisterRequest, body)
        self.oip.shared.register(request.name, request.key, request.offset, request.byte_size)
        return oip.SystemSharedMemoryRegisterResponse().SerializeToString()

    @grpc_errors("SystemSharedMemoryUnregister", SERVICE)
    async def SystemSharedMemoryUnregister(self, body: bytes, context, call: Call) -> bytes:
        request = _parse(oip.SystemSharedMemoryUnregisterRequest, body)
        self.oip.shared.unregister(request.name)
        return oip.SystemSharedMemoryUnregisterResponse().SerializeToString()

    @grpc_errors("CudaSharedMemoryStatus", SERVICE)
    async def CudaSharedMemoryStatus(self, body: bytes, context, call: Call) -> bytes:
        self.oip.shared.cuda_status(_parse(oip.CudaSharedMemoryStatusRequest, body).name)
        return oip.CudaSharedMemoryStatusResponse().SerializeToString()

    @grpc_errors("CudaSharedMemoryRegister", SERVICE)
    async def CudaSharedMemoryRegister(self, body: bytes, context, call: Call) -> bytes:
        _parse(oip.CudaSharedMemoryRegisterRequest, body)
        self.oip.shared.cuda_register()  # raises: not served
        return oip.CudaSharedMemoryRegisterResponse().SerializeToString()

    @grpc_errors("CudaSharedMemoryUnregister", SERVICE)
    async def CudaSharedMemoryUnregister(self, body: bytes, context, call: Call) -> bytes:
        self.oip.shared.cuda_unregister(_parse(oip.CudaSharedMemoryUnregisterRequest, body).name)
        return oip.CudaSharedMemoryUnregisterResponse().SerializeToString()


def _parse(message, body: bytes):
    try:
        return message.FromString(body)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends: the body is not the message
        raise InvalidInput(f"the request body is not a valid inference.{message.__name__}") from None


def add_to_server(servicer: OipServicer, server: grpc.aio.Server) -> str:
    """Register the service with raw-bytes handlers (as serving/frontend/servicer.py does); returns its full name."""
    service = oip.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {m.name: grpc.unary_unary_rpc_method_handler(getattr(servicer, m.name)) for m in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    return service.full_name
