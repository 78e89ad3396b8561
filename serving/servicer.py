"""The gRPC servicer: protobuf <-> arrays and nothing else. The request path is
decode + validate (serving/validate.py) -> batcher (serving/batcher.py) -> model runner
(serving/runner.py) -> split -> response; errors become status codes in serving/errors.py."""
from __future__ import annotations

import time

import grpc
from google.protobuf.message import DecodeError

from recserve import wire
from recserve.v1 import inference_pb2 as pb
from recserve.v1 import inference_pb2_grpc as pb_grpc
from serving.batcher import Work
from serving.errors import MalformedRequest, ModelNotFound, Overloaded, grpc_errors
from serving.metrics import Metrics
from serving.repository import ModelRepository
from serving.validate import decode_lookup, decode_predict


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, repo: ModelRepository, metrics: Metrics) -> None:
        self.repo = repo
        self.metrics = metrics
        self.accepting = True

    def request_done(self, rpc: str, model: str, code: grpc.StatusCode) -> None:
        # Only loaded model names become label values: clients cannot grow the metric set.
        self.metrics.request_done(rpc, model if self.repo.knows(model) else "", code)

    def _deadline(self, context: grpc.aio.ServicerContext):
        remaining = context.time_remaining()
        return None if remaining is None else time.monotonic() + remaining

    def _observe(self, rpc: str, name: str, work: Work, received: float) -> None:
        now = time.monotonic()
        self.metrics.queue_seconds.labels(rpc=rpc, model=name).observe(work.started - work.enqueued)
        self.metrics.compute_seconds.labels(rpc=rpc, model=name).observe(now - work.started)
        self.metrics.total_seconds.labels(rpc=rpc, model=name).observe(now - received)

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise Overloaded("server is shutting down; retry on another replica")

    @grpc_errors("Predict")
    async def Predict(self, request: pb.PredictRequest, context) -> pb.PredictResponse:
        received = time.monotonic()
        self._check_accepting()
        async with self.repo.use(request.model_name, request.model_version) as mv:
            dense, sparse = decode_predict(request, mv.schema)
            work = Work(inputs=(dense, sparse), batch_size=dense.shape[0], deadline=self._deadline(context))
            ctr = await mv.predict.submit(work)
            self._observe("Predict", mv.name, work, received)
            return pb.PredictResponse(ctr=wire.encode(ctr), model_name=mv.name, model_version=mv.version)

    @grpc_errors("Lookup")
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        received = time.monotonic()
        self._check_accepting()
        async with self.repo.use(request.model_name, request.model_version) as mv:
            sparse = decode_lookup(request, mv.schema)
            work = Work(inputs=sparse, batch_size=sparse.batch_size, deadline=self._deadline(context))
            pooled = await mv.lookup.submit(work)
            self._observe("Lookup", mv.name, work, received)
            index = mv.schema.index
            return pb.LookupResponse(keys=sparse.keys, dims=[mv.schema.dims[index[k]] for k in sparse.keys],
                                     pooled=wire.encode(pooled), model_name=mv.name, model_version=mv.version)

    @grpc_errors("GetModelInfo")
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        names = [request.model_name] if request.model_name else sorted(self.repo.models)
        models = []
        for name in names:
            versions = self.repo.versions(name)
            if not versions:
                raise ModelNotFound(f"model {name!r} is not loaded; loaded: {sorted(self.repo.models)}")
            m = versions[0].manifest
            models.append(pb.ModelInfo(
                name=name,
                features=[pb.FeatureInfo(name=f.name, table=f.table, rows=f.rows, dim=f.dim, pooling=f.pooling,
                                         weight_dtype=f.weight_dtype) for f in m.features],
                dense_features=m.dense_features,
                versions=[pb.ModelVersionInfo(version=v.version, state=v.state, device=v.devices,
                                              model_sha256=v.manifest.files.get("model.pt", "")) for v in versions],
                max_batch_size=versions[0].schema.max_batch_size,
                manifest_json=m.to_json(),
            ))
        return pb.GetModelInfoResponse(models=models)


def _lenient(message_class):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            return MalformedRequest(message_class.DESCRIPTOR.full_name)

    return parse


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Register the Inference service like the generated ``add_InferenceServicer_to_server``, but
    with request parsing that turns undecodable bytes into INVALID_ARGUMENT."""
    service = pb.DESCRIPTOR.services_by_name["Inference"]
    handlers = {}
    for method in service.methods:
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=_lenient(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
