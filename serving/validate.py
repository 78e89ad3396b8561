"""Request validation: located protobuf payloads (serving/protowire.py) -> arrays in the model's own
layout, or InvalidInput.

Everything a bad request can get wrong is caught before it shares a model call: here, in the front
end, the structure (vectorised numpy over views of the received bytes, no copies); ids against each
feature's row count on the model's device, per request, before the merge (serving/assemble.py).
FBGEMM's inference kernels do no bounds checks (TorchRec sets BoundsCheckMode.NONE): an id outside
its table would read other memory.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from recserve.manifest import Manifest
from serving.errors import InvalidInput
from serving.protowire import RawRequest, view


@dataclass(frozen=True)
class Schema:
    """What a model accepts, from its manifest."""

    feature_names: Tuple[str, ...]
    rows: Tuple[int, ...]
    dims: Tuple[int, ...]
    dense_features: int
    max_batch_size: int
    max_ids: int

    @staticmethod
    def from_manifest(m: Manifest, max_batch_size: int, max_ids: int) -> "Schema":
        return Schema(
            feature_names=tuple(f.name for f in m.features),
            rows=tuple(f.rows for f in m.features),
            dims=tuple(f.dim for f in m.features),
            dense_features=m.dense_features,
            max_batch_size=max_batch_size,
            max_ids=max_ids,
        )

    @functools.cached_property
    def index(self) -> Dict[str, int]:
        """Feature name -> position in the model (computed once; read on every request)."""
        return {n: i for i, n in enumerate(self.feature_names)}


@dataclass
class SparseBatch:
    """A validated KJT as it came (views of the request's bytes, no copies): ``lengths`` [K, B] and
    ``values`` in request key order; ``positions[k]`` is key k's index in the model's features.
    Ids are range-checked on the model's device (serving/assemble.py), vectorised over the batch."""

    keys: List[str]
    positions: Tuple[int, ...]
    lengths: np.ndarray  # int32 or int64 [K, B]
    values: np.ndarray  # int64 or int32 [N]
    totals: np.ndarray  # int64 [K]: ids per key
    batch_size: int
    in_model_order: bool  # every model feature, in model order: the request is the model's KJT as is


def quoted(text: str, limit: int = 64) -> str:
    """``text`` as a message may quote it: a bounded prefix (a 16 KiB name must not make the error
    larger than gRPC's metadata limit)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def decode_sparse(buf: bytes, request: RawRequest, schema: Schema, batch_size: Optional[int]) -> SparseBatch:
    """The request's KJT as views of its bytes, checked (:func:`check_sparse`)."""
    lengths = view(buf, request.lengths, "sparse.lengths", ("int32", "int64"), ndim=1)
    values = view(buf, request.values, "sparse.values", ("int64", "int32"), ndim=1)
    return check_sparse(request.keys, lengths, values, schema, batch_size)


def check_sparse(keys: Sequence[str], lengths: np.ndarray, values: np.ndarray, schema: Schema,
                 batch_size: Optional[int]) -> SparseBatch:
    """A KJT given as arrays (``lengths`` 1-D, key-major; ``values`` 1-D), checked so that no integer in
    it can wrap: every length lies in [0, number of ids] before anything is summed, and sums are int64
    (at most 2**31 lengths of at most 2**28 ids each). Every protocol's translator ends here."""
    index = schema.index
    if not keys and batch_size is None:
        raise InvalidInput("sparse.keys: at least one key is required")
    if len(keys) > len(schema.feature_names):
        raise InvalidInput(f"sparse.keys: {len(keys)} keys, the model has {len(schema.feature_names)} features")
    seen = set()
    for k in keys:
        if k not in index:
            raise InvalidInput(f"sparse.keys: unknown feature {quoted(k)}; the model has {list(schema.feature_names)}")
        if k in seen:
            raise InvalidInput(f"sparse.keys: feature {quoted(k)} appears more than once")
        seen.add(k)
    n_ids = values.shape[0]
    if n_ids > schema.max_ids:
        raise InvalidInput(f"sparse.values: {n_ids} ids exceed the server's limit of {schema.max_ids} "
                           "per request; split the request")
    if keys:
        if lengths.shape[0] % len(keys):
            raise InvalidInput(f"sparse.lengths: {lengths.shape[0]} entries is not a multiple of {len(keys)} keys")
        b = lengths.shape[0] // len(keys)
        if batch_size is not None and b != batch_size:
            raise InvalidInput(f"sparse.lengths: {lengths.shape[0]} entries = {len(keys)} keys x {b} samples, "
                               f"but dense has {batch_size} samples")
        batch_size = b
    elif lengths.shape[0] or n_ids:
        raise InvalidInput("sparse: lengths/values given without keys")
    _check_batch_size(batch_size, schema)
    per_key = lengths.reshape(len(keys), batch_size)
    if per_key.size:
        if per_key.min() < 0:
            k, _ = np.argwhere(per_key < 0)[0]
            raise InvalidInput(f"sparse.lengths: negative length for feature {quoted(keys[k])}")
        if per_key.max() > n_ids:
            raise InvalidInput(f"sparse.lengths: a bag of {int(per_key.max())} ids, but sparse.values has {n_ids}")
    totals = per_key.sum(axis=1, dtype=np.int64)
    if int(totals.sum()) != n_ids:
        raise InvalidInput(f"sparse.lengths sum to {int(totals.sum())} but sparse.values has {n_ids} ids")
    positions = tuple(index[k] for k in keys)
    return SparseBatch(keys=list(keys), positions=positions, lengths=per_key, values=values, totals=totals,
                       batch_size=batch_size, in_model_order=positions == tuple(range(len(schema.feature_names))))


def id_error(sparse: SparseBatch, schema: Schema) -> str:
    """The message for a request whose ids the device check found out of range (slow path)."""
    start = 0
    for k, t, n in zip(sparse.keys, sparse.positions, sparse.totals):
        seg = sparse.values[start : start + int(n)]
        start += int(n)
        if seg.size and (seg.min() < 0 or seg.max() >= schema.rows[t]):
            bad = int(seg.min()) if seg.min() < 0 else int(seg.max())
            return f"sparse.values: id {bad} of feature {k!r} is outside [0, {schema.rows[t]})"
    return "sparse.values: an id is outside its table"


def _check_batch_size(batch_size: int, schema: Schema) -> None:
    if batch_size < 1:
        raise InvalidInput("batch size must be >= 1 sample")
    if batch_size > schema.max_batch_size:
        raise InvalidInput(f"batch size {batch_size} exceeds the server's max batch size {schema.max_batch_size}; "
                           "split the request")


def decode_dense(buf: bytes, request: RawRequest, schema: Schema) -> np.ndarray:
    return check_dense(view(buf, request.dense, "dense", ("float32",), ndim=2), schema)


def check_dense(dense: np.ndarray, schema: Schema) -> np.ndarray:
    """float32 [B, F]: F the model's dense features, B within the batch limit, every value finite."""
    if dense.shape[1] != schema.dense_features:
        raise InvalidInput(f"dense: expected {schema.dense_features} features per sample, got shape {list(dense.shape)}")
    _check_batch_size(dense.shape[0], schema)
    if not np.isfinite(dense).all():
        row = int(np.argwhere(~np.isfinite(dense))[0][0])
        raise InvalidInput(f"dense: non-finite value in sample {row}")
    return dense


def decode_predict(buf: bytes, request: RawRequest, schema: Schema) -> Tuple[np.ndarray, SparseBatch]:
    dense = decode_dense(buf, request, schema)
    return dense, decode_sparse(buf, request, schema, dense.shape[0])


def decode_lookup(buf: bytes, request: RawRequest, schema: Schema) -> SparseBatch:
    return decode_sparse(buf, request, schema, None)


def lookup_columns(schema: Schema, keys: Sequence[str]) -> np.ndarray:
    """Column indices of ``keys`` (request order) in the model's pooled output."""
    offsets = np.concatenate(([0], np.cumsum(schema.dims)))
    index = schema.index
    return np.concatenate([np.arange(offsets[index[k]], offsets[index[k] + 1]) for k in keys])
