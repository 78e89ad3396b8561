"""The Open Inference Protocol (KServe v2 / Triton gRPC, service ``inference.GRPCInferenceService``):
a translator onto the same path as recserve.v1 (serving/frontend/servicer.py). Inputs -> the arrays
serving/frontend/validate.py checks (``check_dense``, ``check_sparse``) -> ``EngineLink.run``, where its
requests are batched with recserve.v1's -> outputs. Errors become status codes, and requests are
counted, in serving/frontend/status.py ``grpc_errors``. The tensor contract is documented in
protos/recserve/oip/grpc_predict_v2.proto."""
from __future__ import annotations

import asyncio
import json
from importlib import metadata
from typing import Dict, List, Optional, Tuple

import grpc
import numpy as np

from recserve.manifest import MAX_VERSION, parse_version_name
from recserve.oip import grpc_predict_v2_pb2 as oip
from recserve.v1 import inference_pb2 as pb
from serving.errors import InvalidInput, Overloaded, ServingError
from serving.frontend.status import Call, grpc_errors
from serving.frontend.oip import wire
from serving.frontend.link import resolve_version
from serving.frontend.oip.repository import RepositoryExtension, parse as _parse
from serving.model_config import LABEL_RE
from serving.frontend.servicer import deadline
from serving.ipc import Schema
from serving.frontend.validate import SparseBatch, check_dense, check_sparse, quoted

OUTPUTS = ("ctr", "pooled")
PLATFORM = "recserve"
SERVICE = oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


def _server_version() -> str:
    try:
        return metadata.version("recserve")
    except metadata.PackageNotFoundError:  # run from a source tree (PYTHONPATH), not installed
        return ""


def expected_inputs(schema: Schema) -> Dict[str, Tuple[Tuple[str, ...], int, int]]:
    """Input name -> (accepted dtypes, rank, most elements)."""
    expected = {"dense": (("float32",), 2, schema.max_batch_size * schema.dense_features)}
    for f in schema.feature_names:
        expected[f"{f}_lengths"] = (("int32", "int64"), 1, schema.max_batch_size)
        expected[f"{f}_ids"] = (("int64", "int32"), 1, schema.max_ids)
    return expected


def to_batch(inputs: Dict[str, np.ndarray], schema: Schema, need_dense: bool
             ) -> Tuple[Optional[np.ndarray], SparseBatch]:
    """The request's inputs as recserve.v1 would carry them: dense, and the KJT of every feature in
    model order (a feature left out: empty bags), checked by serving/frontend/validate.py."""
    dense = inputs.get("dense")
    if dense is not None:
        dense = check_dense(dense, schema)
    elif need_dense:
        raise InvalidInput(f"input 'dense' (FP32 [B, {schema.dense_features}]) is required for output 'ctr'")
    b = None if dense is None else dense.shape[0]
    sent: List[Tuple[int, np.ndarray, np.ndarray]] = []
    for position, f in enumerate(schema.feature_names):
        lengths, ids = inputs.get(f"{f}_lengths"), inputs.get(f"{f}_ids")
        if (lengths is None) != (ids is None):
            raise InvalidInput(f"inputs {quoted(f + '_lengths')} and {quoted(f + '_ids')} go together; "
                               "send both, or neither for empty bags")
        if lengths is None:
            continue
        if b is None:
            b = lengths.shape[0]
        if lengths.shape[0] != b:
            raise InvalidInput(f"input {quoted(f + '_lengths')}: {lengths.shape[0]} samples, but the request has {b}")
        sent.append((position, lengths, ids))
    if b is None:
        raise InvalidInput("no input gives the batch size: send 'dense' or a '<feature>_lengths'")
    all_lengths = np.zeros((len(schema.feature_names), b),
                           dtype=np.result_type(np.int32, *(lengths for _, lengths, _ in sent)))
    for position, lengths, _ in sent:
        all_lengths[position] = lengths
    for position, lengths, ids in sent:  # check_sparse compares the totals over all features; first each one
        # Every length within [0, ids sent] before the sum (none can wrap); check_sparse names the others.
        if lengths.size and 0 <= lengths.min() and lengths.max() <= ids.shape[0]:
            total = int(lengths.sum(dtype=np.int64))
            if total != ids.shape[0]:
                f = schema.feature_names[position]
                raise InvalidInput(f"input {quoted(f + '_lengths')} sums to {total}, "
                                   f"but {quoted(f + '_ids')} has {ids.shape[0]} ids")
    values = np.concatenate([ids for _, _, ids in sent]) if sent else np.zeros(0, np.int64)
    return dense, check_sparse(schema.feature_names, all_lengths.ravel(), values, schema, b)


def _outputs_to_run(requested: List[str], only: Optional[str]) -> List[str]:
    """The requested outputs (none: all, as Triton answers), narrowed by the request parameter
    ``outputs`` (comma-separated) for clients that request every output (perf_analyzer does)."""
    names = list(requested) + ([n.strip() for n in only.split(",")] if only is not None else [])
    for name in names:
        if name not in OUTPUTS:
            raise InvalidInput(f"unknown output {quoted(name)}; the model has {list(OUTPUTS)}")
    for name in set(requested):  # each one would be another model call
        if requested.count(name) > 1:
            raise InvalidInput(f"output {quoted(name)} is requested {requested.count(name)} times; request each once")
    wanted = list(requested) or list(OUTPUTS)
    if only is not None:
        wanted = [n for n in wanted if n in names[len(requested):]]
        if not wanted:
            raise InvalidInput(f"parameters['outputs'] = {quoted(only)} keeps none of the requested outputs {requested}")
    return wanted


def _version(text: str) -> Tuple[int, str]:
    """OIP's version string as (version, label): "" = the default version (0 in recserve.v1), a
    version number, or a version label (its config.json's version_labels)."""
    if not text:
        return 0, ""
    version = parse_version_name(text)  # the directory's name, as written: "01" and "0" are no versions
    if version is not None:
        return version, ""
    if LABEL_RE.match(text):
        return 0, text
    raise InvalidInput(f"model_version: {quoted(text)} is neither a version number (1 to {MAX_VERSION}, no leading "
                       "zeros) nor a version label; send \"\" for the default version")


class OipServicer(RepositoryExtension):
    def __init__(self, engine, metrics, buffer_limit: int, model_control: str = "poll") -> None:
        self.engine = engine  # serving.frontend.EngineLink
        self.metrics = metrics
        self.buffer_limit = buffer_limit  # ServerConfig.frontend_buffer_bytes
        self.model_control = model_control  # ServerConfig.model_control

    @property
    def ready(self) -> bool:
        return self.engine.ready and self.engine.accepting

    @grpc_errors("ServerLive", SERVICE)
    async def ServerLive(self, body: bytes, context, call: Call) -> bytes:
        return oip.ServerLiveResponse(live=True).SerializeToString()

    @grpc_errors("ServerReady", SERVICE)
    async def ServerReady(self, body: bytes, context, call: Call) -> bytes:
        return oip.ServerReadyResponse(ready=self.ready).SerializeToString()

    @grpc_errors("ServerMetadata", SERVICE)
    async def ServerMetadata(self, body: bytes, context, call: Call) -> bytes:
        return oip.ServerMetadataResponse(name="recserve", version=_server_version(),
                                          extensions=["model_configuration", "model_repository"]).SerializeToString()

    @grpc_errors("ModelReady", SERVICE)
    async def ModelReady(self, body: bytes, context, call: Call) -> bytes:
        request = _parse(oip.ModelReadyRequest, body)
        try:
            self.engine.model(request.name, *_version(request.version))
            call.model, ready = request.name, True
        except ServingError:
            ready = False
        return oip.ModelReadyResponse(ready=ready).SerializeToString()

    @grpc_errors("ModelMetadata", SERVICE)
    async def ModelMetadata(self, body: bytes, context, call: Call) -> bytes:
        request = _parse(oip.ModelMetadataRequest, body)
        schema, versions = self._model(request.name, request.version, call)
        tensor = oip.ModelMetadataResponse.TensorMetadata
        return oip.ModelMetadataResponse(
            name=request.name, versions=versions, platform=PLATFORM,
            inputs=[tensor(name=n, datatype=t, shape=s) for n, t, s, _ in _inputs(schema)],
            outputs=[tensor(name=n, datatype="FP32", shape=s) for n, s in _outputs(schema)]).SerializeToString()

    @grpc_errors("ModelConfig", SERVICE)
    async def ModelConfig(self, body: bytes, context, call: Call) -> bytes:
        request = _parse(oip.ModelConfigRequest, body)
        schema, _ = self._model(request.name, request.version, call)
        settings = json.loads(pb.ModelInfo.FromString(self.engine.known(request.name).info).config_json or "{}")
        data_type = {"FP32": oip.TYPE_FP32, "INT32": oip.TYPE_INT32, "INT64": oip.TYPE_INT64}
        config = oip.ModelConfig(
            name=request.name, platform=PLATFORM, backend=PLATFORM, max_batch_size=0,
            input=[oip.ModelInput(name=n, data_type=data_type[t], dims=s, optional=o) for n, t, s, o in _inputs(schema)],
            output=[oip.ModelOutput(name=n, data_type=oip.TYPE_FP32, dims=s) for n, s in _outputs(schema)],
            parameters={"max_batch_size": oip.ModelParameter(string_value=str(schema.max_batch_size)),
                        **{key: oip.ModelParameter(string_value=json.dumps(value)) for key, value in settings.items()
                           if key != "max_batch_size"}})
        return oip.ModelConfigResponse(config=config).SerializeToString()

    @grpc_errors("ModelInfer", SERVICE)
    async def ModelInfer(self, body: bytes, context, call: Call) -> bytes:
        with call.step("decode"):
            request = wire.parse_infer(body)
            version, label = _version(request.model_version)
            model = self.engine.model(request.model_name, version, label)
            call.model, call.version = request.model_name, str(model.version)
            wanted = _outputs_to_run(request.outputs, request.parameters.get("outputs"))
            inputs = wire.arrays(body, request, expected_inputs(model.schema))
            dense, sparse = to_batch(inputs, model.schema, need_dense="ctr" in wanted)
            call.batch_size = sparse.batch_size
        until = deadline(context)
        # The model calls of one request hold their slots together.
        self.engine.check_fits(sum(self.engine.slot_bytes("Predict" if name == "ctr" else "Lookup", model, sparse,
                                                          dense if name == "ctr" else None) for name in wanted))

        async def run(output: str, timed: Optional[Call]) -> Tuple[int, np.ndarray]:
            rpc = "Predict" if output == "ctr" else "Lookup"
            async with self.engine.run(rpc, model, sparse, dense if output == "ctr" else None, bool(version or label),
                                       until, timed) as (answered, result):
                return answered, np.array(result)  # the shared buffer's slot is freed when the block ends

        # The first model call's queue and model times are the request's (where traced).
        results = await _all([run(name, call if i == 0 else None) for i, name in enumerate(wanted)])
        if len({answered for answered, _ in results}) > 1:  # a swap between the two model calls
            raise Overloaded(f"model {quoted(request.model_name)} changed version during the request; retry")
        call.version = str(results[0][0])
        with call.step("encode"):
            return wire.infer_response([(name, array) for name, (_, array) in zip(wanted, results)],
                                       request.model_name, str(results[0][0]), request.id)

    def _model(self, name: str, version: str, call: Call) -> Tuple[Schema, List[str]]:
        """A loaded model version's schema (a number, a label, or "": the default version) and the
        model's versions that take requests, newest first."""
        model = self.engine.known(name)
        state = resolve_version(model, *_version(version))
        call.model = name
        return state.schema, [str(v) for v in sorted(model.versions, reverse=True)]


def _inputs(schema: Schema) -> List[Tuple[str, str, List[int], bool]]:
    """(name, datatype, shape, optional) of every input (-1: varies per request)."""
    out = [("dense", "FP32", [-1, schema.dense_features], False)]
    for f in schema.feature_names:
        out += [(f"{f}_lengths", "INT32", [-1], True), (f"{f}_ids", "INT64", [-1], True)]
    return out


def _outputs(schema: Schema) -> List[Tuple[str, List[int]]]:
    return [("ctr", [-1]), ("pooled", [-1, sum(schema.dims)])]


async def _all(coroutines) -> list:
    """Run the model calls of one request together; if one fails, the others are cancelled."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


def add_to_server(servicer: OipServicer, server: grpc.aio.Server) -> str:
    """Register the service with raw-bytes handlers (as serving/frontend/servicer.py does); returns its full name."""
    service = oip.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {m.name: grpc.unary_unary_rpc_method_handler(getattr(servicer, m.name)) for m in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    return service.full_name
