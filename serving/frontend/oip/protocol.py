"""The Open Inference Protocol (KServe v2) without its transport: what gRPC (oip/servicer.py) and
HTTP/REST (oip/rest.py) both answer, so that the two cannot drift. A transport reads the request
into names, strings and arrays, calls one method here, and writes what it returns; errors are the
typed ones of serving/errors.py, turned into status codes by serving/frontend/status.py.

Inference: input arrays -> the checks of serving/frontend/validate.py (``check_dense``,
``check_sparse``, as recserve.v1's) -> ``EngineLink.run``, where its requests are batched with
recserve.v1's. The tensor contract is documented in protos/recserve/oip/grpc_predict_v2.proto.
"""
from __future__ import annotations

import asyncio
import functools
import json
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from recserve.manifest import MAX_VERSION, MODEL_NAME_RE, MODEL_NAME_RULE, parse_version_name
from recserve.v1 import inference_pb2 as pb
from serving.errors import ControlOff, InvalidInput, ModelNotFound, Overloaded, ServingError
from serving.frontend.link import plan, resolve_version
from serving.frontend.oip.shm import NO_SHARED_MEMORY, Placement, SharedMemory
from serving.frontend.status import Call
from serving.frontend.validate import IdSegments, SparseBatch, check_dense, check_sparse, lookup_columns, quoted
from serving.ipc import ModelState, Schema, ServedModel, aligned
from serving.model_config import LABEL_RE
from serving.statistics import VersionStatistics

OUTPUTS = ("ctr", "pooled")
NO_IDS = np.zeros(0, np.int64)
PLATFORM = "recserve"
EXTENSIONS = ["model_configuration", "statistics", "model_repository"]  # HTTP adds "binary_tensor_data"
# tritonclient's unload_model always sends it (false by default); no model here has dependents (an
# ensemble's steps in Triton), so either value unloads the model alone.
UNLOAD_PARAMETERS = {"unload_dependents"}
Expected = Dict[str, Tuple[Tuple[str, ...], int, int]]  # input -> (accepted dtypes, rank, most elements)


def server_version() -> str:
    try:
        return metadata.version("recserve")
    except metadata.PackageNotFoundError:  # run from a source tree (PYTHONPATH), not installed
        return ""


# Every per-sample feature in three tensors, the model's KJT as recserve.v1 carries it (instead of
# two inputs per feature): bag sizes [features, B], one row per feature in model order, and all their
# ids, feature after feature. No feature's inputs can take these names (theirs are "<feature>_...").
PACKED_LENGTHS, PACKED_IDS = "lengths", "ids"


@functools.lru_cache(maxsize=64)
def expected_inputs(schema: Schema) -> Expected:
    """Input name -> (accepted dtypes, rank, most elements) (shared: not to be changed)."""
    expected = {"dense": (("float32",), 2, schema.max_batch_size * schema.dense_features),
                PACKED_LENGTHS: (("int32", "int64"), 2, schema.max_batch_size * len(schema.feature_names)),
                PACKED_IDS: (("int64", "int32"), 1, schema.max_ids)}
    for _, _, lengths_name, ids_name, shared_name in _input_names(schema):
        expected[lengths_name] = (("int32", "int64"), 1, schema.max_batch_size)
        for name in (ids_name, shared_name):
            if name:
                expected[name] = (("int64", "int32"), 1, schema.max_ids)
    return expected


def model_inputs(schema: Schema, settings: dict) -> List[Tuple[str, str, List[int], bool]]:
    """(name, datatype, shape, optional) of every input (-1: varies per request); where the model's
    effective configuration (``settings``) has ``oip_inputs`` "packed": the packed form's alone,
    none optional."""
    ids = ids_datatype(schema)
    if settings.get("oip_inputs", "all") == "packed":
        return [("dense", "FP32", [-1, schema.dense_features], False), (PACKED_LENGTHS, "INT32", [-1, -1], False),
                (PACKED_IDS, ids, [-1], False)]
    out = [("dense", "FP32", [-1, schema.dense_features], False)]
    for _, _, lengths_name, ids_name, shared_name in _input_names(schema):
        out += [(lengths_name, "INT32", [-1], True), (ids_name, ids, [-1], True)]
        out += [(shared_name, ids, [-1], True)] if shared_name else []
    return out + [(PACKED_LENGTHS, "INT32", [-1, -1], True), (PACKED_IDS, ids, [-1], True)]  # the packed form


def ids_datatype(schema: Schema) -> str:
    """The ids' datatype a client should send: INT32 where every table has fewer than 2**31 rows
    (half the bytes of INT64 on the wire, and what the engine's batch holds), else INT64. Both are
    accepted either way; perf_analyzer and clients that follow ModelMetadata send this one."""
    return "INT32" if schema.id_dtype == np.int32 else "INT64"


def model_outputs(schema: Schema) -> List[Tuple[str, List[int]]]:
    return [("ctr", [-1]), ("pooled", [-1, schema.pooled_width])]


def model_metadata(name: str, versions: List[str], schema: Schema, settings: dict) -> dict:
    """ModelMetadata (JSON form): the tensor contract (``settings``: the model's effective configuration)."""
    return {"name": name, "versions": versions, "platform": PLATFORM,
            "inputs": [{"name": n, "datatype": t, "shape": s}
                       for n, t, s, _ in model_inputs(schema, settings)],
            "outputs": [{"name": n, "datatype": "FP32", "shape": s} for n, s in model_outputs(schema)]}


def model_config(name: str, schema: Schema, settings: dict) -> dict:
    """Triton's model configuration (JSON form; what perf_analyzer reads): max_batch_size 0 in
    Triton's sense, the server's limit in parameters["max_batch_size"]; the model's effective
    configuration (serving/model_config.py ``describe``: its config.json over the server's flags)
    in the other parameters, each as JSON."""
    parameters = {key: {"string_value": json.dumps(value)} for key, value in settings.items() if key != "max_batch_size"}
    return {"name": name, "platform": PLATFORM, "backend": PLATFORM, "max_batch_size": 0,
            "input": [{"name": n, "data_type": f"TYPE_{t}", "dims": s, "optional": o}
                      for n, t, s, o in model_inputs(schema, settings)],
            "output": [{"name": n, "data_type": "TYPE_FP32", "dims": s} for n, s in model_outputs(schema)],
            "parameters": {"max_batch_size": {"string_value": str(schema.max_batch_size)}, **parameters}}


@functools.lru_cache(maxsize=64)
def _input_names(schema: Schema) -> Tuple[Tuple[int, str, str, str, Optional[str]], ...]:
    """(position, feature, its lengths, ids and shared ids input names) of every feature. Where a
    feature's shared input would be another feature's ids (features "u" and "u_shared": "u_shared_ids"),
    the name is the other feature's and "u" has no shared input (recserve.v1 sends it shared)."""
    ids_names = {f"{f}_ids" for f in schema.feature_names}
    return tuple((p, f, f"{f}_lengths", f"{f}_ids", None if f"{f}_shared_ids" in ids_names else f"{f}_shared_ids")
                 for p, f in enumerate(schema.feature_names))


def to_batch(inputs: Dict[str, np.ndarray], schema: Schema, need_dense: bool
             ) -> Tuple[Optional[np.ndarray], SparseBatch]:
    """The request's inputs as recserve.v1 would carry them: dense, the KJT of every per-sample
    feature in model order (packed: ``lengths`` and ``ids``; or per feature, a feature left out
    having empty bags) and the shared bags (``<feature>_shared_ids``: one bag for every sample,
    recserve.v1's ``shared_*``), checked by serving/frontend/validate.py."""
    dense = inputs.get("dense")
    if dense is not None:
        dense = check_dense(dense, schema)
    elif need_dense:
        raise InvalidInput(f"input 'dense' (FP32 [B, {schema.dense_features}]) is required for output 'ctr'")
    b = None if dense is None else dense.shape[0]
    names = _input_names(schema)
    shared = [(f, inputs[s]) for _, f, _, _, s in names if s in inputs]
    shared_names = {f for f, _ in shared}
    per_sample = [f for f in schema.feature_names if f not in shared_names]
    if PACKED_LENGTHS in inputs or PACKED_IDS in inputs:
        return dense, _packed(inputs.get(PACKED_LENGTHS), inputs.get(PACKED_IDS), inputs, shared, per_sample, b,
                              schema)
    sent: List[Tuple[str, np.ndarray, np.ndarray]] = []  # (feature, lengths, ids) of the per-sample features sent
    for position, f, lengths_name, ids_name, _ in names:
        lengths, ids = inputs.get(lengths_name), inputs.get(ids_name)
        if lengths is None or ids is None:
            if lengths is not None or ids is not None:
                raise InvalidInput(f"inputs {quoted(lengths_name)} and {quoted(ids_name)} go together; "
                                   "send both, or neither for empty bags")
            continue
        if f in shared_names:
            raise InvalidInput(f"feature {quoted(f)} is sent both per sample ({quoted(ids_name)}) and shared "
                               f"({quoted(f + '_shared_ids')}); send one of them")
        if b is None:
            b = lengths.shape[0]
        if lengths.shape[0] != b:
            raise InvalidInput(f"input {quoted(lengths_name)}: {lengths.shape[0]} samples, but the request has {b}")
        sent.append((f, lengths, ids))
    if b is None:
        if not shared:
            raise InvalidInput("no input gives the batch size: send 'dense' or a '<feature>_lengths'")
        b = 1  # shared bags alone: one sample (as recserve.v1's Lookup of shared bags only)
    if len(sent) == len(per_sample):  # every per-sample feature sent (in model order, as ``names`` is)
        all_lengths = np.stack([lengths for _, lengths, _ in sent]) if sent else np.zeros((0, b), np.int32)
        values = IdSegments([ids for _, _, ids in sent])
    else:  # a feature left out: its bags are empty
        all_lengths = np.zeros((len(per_sample), b), dtype=np.result_type(np.int32, *(l for _, l, _ in sent)))
        ids_of = {}
        for f, lengths, ids in sent:
            all_lengths[per_sample.index(f)] = lengths
            ids_of[f] = ids
        values = IdSegments([ids_of.get(f, NO_IDS) for f in per_sample])
    try:
        return dense, check_sparse(per_sample, all_lengths.ravel(), values, schema, b, _shared_part(shared))
    except InvalidInput:
        _feature_totals(sent)  # a feature whose lengths do not add up to its own ids: name it
        raise


def _shared_part(shared: List[Tuple[str, np.ndarray]]) -> Optional[Tuple[List[str], np.ndarray, np.ndarray]]:
    """The shared bags as check_sparse takes them: keys, ids per bag, their ids."""
    if not shared:
        return None
    return ([f for f, _ in shared], np.array([ids.shape[0] for _, ids in shared], np.int64),
            np.concatenate([ids for _, ids in shared]))


def _packed(lengths: Optional[np.ndarray], ids: Optional[np.ndarray], inputs: Dict[str, np.ndarray],
            shared: List[Tuple[str, np.ndarray]], per_sample: List[str], b: Optional[int], schema: Schema
            ) -> SparseBatch:
    """The per-sample features (``per_sample``: those not sent shared, model order) sent packed:
    ``lengths`` [features, B], a row each, and ``ids`` theirs, feature after feature."""
    if lengths is None or ids is None:
        raise InvalidInput(f"inputs {quoted(PACKED_LENGTHS)} and {quoted(PACKED_IDS)} go together; send both")
    per_feature = [name for _, _, lengths_name, ids_name, _ in _input_names(schema)
                   for name in (lengths_name, ids_name) if name in inputs]
    if per_feature:
        raise InvalidInput(f"inputs {quoted(PACKED_LENGTHS)} and {quoted(PACKED_IDS)} carry every per-sample "
                           f"feature; send them or the per-feature inputs (got {quoted(per_feature[0])}), not both")
    if lengths.shape[0] != len(per_sample):
        raise InvalidInput(f"input {quoted(PACKED_LENGTHS)}: {lengths.shape[0]} rows, but the request has "
                           f"{len(per_sample)} per-sample features (one row each, in model order"
                           f"{', the shared ones left out' if shared else ''})")
    if b is not None and lengths.shape[1] != b:
        raise InvalidInput(f"input {quoted(PACKED_LENGTHS)}: {lengths.shape[1]} samples, but the request has {b}")
    b = lengths.shape[1] if b is None else b
    return check_sparse(per_sample, lengths.ravel(), ids, schema, b, _shared_part(shared))


def _feature_totals(sent: List[Tuple[str, np.ndarray, np.ndarray]]) -> None:
    """On a refused request: the first feature whose lengths are sane (each in [0, its ids sent]) but
    do not sum to its ids gets the error, in OIP's terms (check_sparse only sees every feature's
    totals together)."""
    for f, lengths, ids in sent:
        if lengths.shape[0] and 0 <= int(lengths.min()) and int(lengths.max()) <= ids.shape[0]:
            total = int(lengths.sum(dtype=np.int64))
            if total != ids.shape[0]:
                raise InvalidInput(f"input {quoted(f + '_lengths')} sums to {total}, "
                                   f"but {quoted(f + '_ids')} has {ids.shape[0]} ids")


def request_options(parameters: Dict[str, object], transport_deadline: Optional[float]
                    ) -> Tuple[Optional[str], Optional[float]]:
    """A request's parameters that the server acts on, read alike over gRPC and HTTP: ``outputs``
    (see :func:`outputs_to_run`) and Triton's ``timeout`` (microseconds; tritonclient's ``timeout=``),
    the deadline on time.monotonic() being the earlier of it and the transport's own (gRPC's)."""
    only = parameters.get("outputs")
    if only is not None and not isinstance(only, str):
        raise InvalidInput("parameters['outputs'] must be a string (comma-separated output names)")
    timeout_us = parameters.get("timeout")
    if timeout_us is None or (type(timeout_us) is int and timeout_us == 0):  # 0: Triton's "no timeout"
        return only, transport_deadline
    if type(timeout_us) is not int or not 0 < timeout_us < 1 << 63:
        raise InvalidInput("parameters['timeout'] must be an integer (microseconds; 0: none) from 0 to 2^63 - 1")
    until = time.monotonic() + timeout_us / 1e6
    return only, until if transport_deadline is None else min(until, transport_deadline)


def outputs_to_run(requested: List[str], only: Optional[str]) -> List[str]:
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


def version_choice(text: str) -> Tuple[int, str]:
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


@dataclass
class InferRequest:
    """An inference request as both transports read it; ``arrays(expected)`` gives its inputs,
    checked for name, datatype, rank and size against the model's (``expected_inputs``)."""

    model_name: str
    model_version: str
    outputs: List[str]  # requested output names, in order
    only: Optional[str]  # the string parameter ``outputs``
    arrays: Callable[[Expected], Dict[str, np.ndarray]]
    # Outputs to write into shared memory: checked before the model runs, and pinned to their
    # regions' registrations, in place (the transport writes the answer with these).
    output_places: Dict[str, Placement] = field(default_factory=dict)


class Oip:
    """The protocol's operations on the engine link (serving/frontend/link.py)."""

    def __init__(self, engine, model_control: str = "poll", shared: SharedMemory = NO_SHARED_MEMORY) -> None:
        self.engine = engine
        self.model_control = model_control  # ServerConfig.model_control
        self.shared = shared  # the system shared memory extension (serving/frontend/oip/shm.py)

    @property
    def extensions(self) -> List[str]:
        return EXTENSIONS + (["system_shared_memory"] if self.shared.enabled else [])

    @property
    def ready(self) -> bool:
        return self.engine.ready and self.engine.accepting

    def served(self, name: str, version: str, call: Call, detailed: bool = True) -> None:
        """Raises the client's error unless the model (version "": its default) takes requests now. An
        unknown model's 404 lists no other model: model ready needs no token (serving/frontend/security.py).
        Not ``detailed`` (no valid token): an unknown version of a known model gets the same 404, not
        the versions or labels the model serves."""
        choice = version_choice(version)
        named = f" version {choice[0]}" if choice[0] else f" version label {quoted(choice[1])}" if choice[1] else ""
        unknown = ModelNotFound(f"model {quoted(name)}{named} is not loaded")
        if self.engine.ready and name not in self.engine.models:
            raise unknown
        try:
            self.engine.model(name, *choice)
        except ModelNotFound:
            if detailed:
                raise
            raise unknown from None
        call.model = name

    def model_ready(self, name: str, version: str, call: Call) -> bool:
        version_choice(version)  # a string that names no version is the client's error, not "not ready"
        try:
            self.served(name, version, call)
        except ServingError:
            return False
        return True

    def model(self, name: str, version: str, call: Call) -> Tuple[Schema, List[str]]:
        """A loaded model version's schema (a number, a label, or "": the default version) and the
        model's versions that take requests, newest first."""
        state, model = self._resolved(name, version, call)
        return state.schema, [str(v) for v in sorted(model.versions, reverse=True)]

    def _resolved(self, name: str, version: str, call: Call) -> Tuple[ModelState, ServedModel]:
        """The served version a version string names (raises the client's error), and its model."""
        model = self.engine.known(name)
        state = resolve_version(model, *version_choice(version))
        call.model = name
        return state, model

    def settings(self, name: str) -> dict:
        """The model's effective configuration (GetModelInfo's config_json)."""
        return json.loads(pb.ModelInfo.FromString(self.engine.known(name).info).config_json or "{}")

    async def infer(self, request: InferRequest, until: Optional[float], call: Call
                    ) -> Tuple[str, List[Tuple[str, np.ndarray]]]:
        """(the version that answered, [(output name, float32 array)] in the order run)."""
        with call.step("decode"):
            version, label = version_choice(request.model_version)
            model = self.engine.model(request.model_name, version, label)
            call.model, call.version = request.model_name, str(model.version)
            wanted = outputs_to_run(request.outputs, request.only)
            dense, sparse = to_batch(request.arrays(expected_inputs(model.schema)), model.schema,
                                     need_dense="ctr" in wanted)
            call.batch_size = sparse.batch_size
            for name in wanted:
                if name in request.output_places:
                    floats = sparse.batch_size * (model.schema.pooled_width if name == "pooled" else 1)
                    request.output_places[name] = self.shared.reserve(request.output_places[name], 4 * floats,
                                                                      f"output {name!r}")
        # Each model call laid out once: the layouts that check the slots fit are the ones written.
        planned = {name: plan("Predict" if name == "ctr" else "Lookup", model, sparse, dense if name == "ctr" else None)
                   for name in wanted}
        if len(wanted) > 1:  # the model calls of one request hold their slots together (one alone: run checks)
            self.engine.check_fits(sum(aligned(laid_out.layout.slot_bytes) for laid_out in planned.values()))

        async def run(output: str, timed: Optional[Call]) -> Tuple[int, np.ndarray]:
            rpc = "Predict" if output == "ctr" else "Lookup"
            async with self.engine.run(rpc, model, sparse, dense if output == "ctr" else None, bool(version or label),
                                       until, timed, planned[output]) as (answered, result):
                if output == "pooled" and sparse.shared_keys:  # Lookup's columns: per-sample, then shared
                    return answered, np.ascontiguousarray(result[:, np.argsort(lookup_columns(model.schema, sparse.all_keys))])
                return answered, np.array(result)  # the shared buffer's slot is freed when the block ends

        # The first model call's queue and model times are the request's (where traced).
        results = await _all([run(name, call if i == 0 else None) for i, name in enumerate(wanted)])
        if len({answered for answered, _ in results}) > 1:  # a swap between the two model calls
            raise Overloaded(f"model {quoted(request.model_name)} changed version during the request; retry")
        call.version = str(results[0][0])
        return call.version, [(name, array) for name, (_, array) in zip(wanted, results)]

    async def statistics(self, name: str, version: str, call: Call) -> List[dict]:
        """Triton's ``ModelStatistics`` (as JSON: field names, integers) of the loaded versions asked
        for (name "": every model; version "": every loaded version), sorted by model and version."""
        if version and not name:
            raise InvalidInput("a model version needs a model name")
        if name:
            state, _ = self._resolved(name, version, call)  # an unknown model or version: its error
            if version:  # a number or a label: the version it names
                version = str(state.version)
        found = sorted(((n, str(v), s) for (n, v), s in (await self.engine.statistics()).items()
                        if (not name or n == name) and (not version or str(v) == version)),
                       key=lambda entry: (entry[0], int(entry[1])))
        return [model_statistics(*entry) for entry in found]

    # -- the model repository extension -------------------------------------------------------------
    def repository_index(self, repository: str, ready: bool) -> List[dict]:
        """Every model of the repository and every loaded version: name, version ("" for a model
        with none), state (READY, UNLOADING while draining, LOADING, UNAVAILABLE), reason."""
        _one_repository(repository)
        return [{"name": name, "version": version, "state": state, "reason": reason}
                for name, version, state, reason in self.engine.repository_index if not ready or state == "READY"]

    async def control(self, action: str, repository: str, name: str, parameters: dict, call: Call) -> None:
        """Load (or load again) or unload a model, under ``serve --model-control explicit``; returns
        once done: loaded and serving (or the reason it does not, INVALID_ARGUMENT), or unloaded."""
        if self.model_control != "explicit":
            raise ControlOff(f"model {action} is off: this server polls its repository; serve with "
                             "--model-control explicit to load and unload models by request")
        _one_repository(repository)
        unsupported = sorted(set(parameters) - (UNLOAD_PARAMETERS if action == "unload" else set()))
        if unsupported:
            raise InvalidInput(f"parameters are not supported (got {unsupported})")
        error = await self.engine.control(action, name)
        # The engine read the repository for this; its index, sent before its answer, is the current one
        # here (the one the front end had may predate a model just copied in).
        if error and name not in {entry[0] for entry in self.engine.repository_index}:
            raise ModelNotFound(f"no model {quoted(name)} in the repository"
                                + ("" if MODEL_NAME_RE.match(name) else f": {MODEL_NAME_RULE}"))
        if error:
            raise InvalidInput(error)
        call.model = name


def _one_repository(name: str) -> None:
    if name:
        raise InvalidInput(f"repository_name {quoted(name)}: this server serves one repository; send \"\"")


def model_statistics(name: str, version: str, s: VersionStatistics) -> dict:
    """One version's figures as Triton's ``ModelStatistics`` (serving/statistics.py says what each holds)."""
    def duration(count: int, ns: int) -> dict:
        return {"count": count, "ns": ns}

    untimed = duration(s.compute_infer[0], 0)  # inside compute_infer (serving/statistics.py)
    return {
        "name": name, "version": version, "last_inference": s.last_inference_ms,
        "inference_count": s.inference_count, "execution_count": s.execution_count,
        "inference_stats": {"success": duration(*s.success), "fail": duration(*s.fail), "queue": duration(*s.queue),
                            "compute_input": untimed, "compute_infer": duration(*s.compute_infer),
                            "compute_output": untimed, "cache_hit": duration(0, 0), "cache_miss": duration(0, 0)},
        "batch_stats": [{"batch_size": size, "compute_input": duration(count, 0), "compute_infer": duration(count, ns),
                         "compute_output": duration(count, 0)} for size, (count, ns) in sorted(s.batches.items())],
    }


async def _all(coroutines) -> list:
    """Run the model calls of one request together; if one fails, the others are cancelled. One
    alone runs in the caller's task (no task to schedule: a loop round less per request)."""
    if len(coroutines) == 1:
        return [await coroutines[0]]
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
