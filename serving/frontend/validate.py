"""Request validation: located protobuf payloads (serving/frontend/protowire.py) -> arrays, checked,
or InvalidInput; then the request in model feature order (:func:`model_kjt`), which the engine link
writes into the shared buffer in the batch's layout (serving/ipc.py ``write_request``).

Everything a bad request can get wrong is caught here, in the front end, before it shares a model
call: the structure (vectorised numpy over views of the received bytes, no copies) and every id
against its table's row count (a feature's ids are contiguous: one min and one max per feature).
FBGEMM's inference kernels do no bounds checks (TorchRec sets BoundsCheckMode.NONE): an id outside
its table would read other memory, so the engine never sees one.
"""
from __future__ import annotations


from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from serving import ipc
from serving.errors import InvalidInput
from serving.ipc import ModelKJT, Schema, unsigned
from serving.frontend.protowire import RawRequest, view


class IdSegments:
    """The ids of several keys, one array per key, standing for their concatenation without making
    it: the Open Inference Protocol sends an input per feature, each already a view of the request."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = list(parts)
        self.shape = (sum(part.shape[0] for part in self.parts),)


Ids = Union[np.ndarray, IdSegments]


@dataclass
class SparseBatch:
    """A validated KJT as it came (views of the request's bytes, no copies): ``lengths`` [K, B] and
    ``values`` in request key order; ``positions[k]`` is key k's index in the model's features.
    Shared features (one bag for every sample) come apart: ``shared_lengths`` [S] and
    ``shared_values``, expanded to the samples (or pooled once) on the device (serving/engine/assemble.py).
    Every id lies in its table once :func:`check_ids` has passed it (``ids_checked``)."""

    keys: List[str]
    positions: Tuple[int, ...]
    lengths: np.ndarray  # int32 or int64 [K, B]
    values: Ids  # int64 or int32 [N] (or per key: IdSegments)
    totals: np.ndarray  # int64 [K]: ids per key
    batch_size: int
    in_model_order: bool  # every model feature, in model order, none shared: the request is the model's KJT as is
    shared_keys: List[str] = field(default_factory=list)
    shared_positions: Tuple[int, ...] = ()
    shared_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64 [S]: ids per bag
    shared_values: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64 or int32 [M]
    ids_checked: bool = True  # False: check_ids must pass it before any id reaches the engine

    @property
    def all_keys(self) -> List[str]:
        """Every feature sent, per-sample ones first: the order of Lookup's columns."""
        return self.keys + self.shared_keys

    @property
    def all_positions(self) -> Tuple[int, ...]:
        return self.positions + self.shared_positions

    @property
    def expanded_ids(self) -> int:
        """Ids in the model's KJT of this request: each shared id once per sample."""
        return self.values.shape[0] + self.batch_size * self.shared_values.shape[0]


def quoted(text: str, limit: int = 64) -> str:
    """``text`` as a message may quote it: a bounded prefix (a 16 KiB name must not make the error
    larger than gRPC's metadata limit)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def decode_sparse(buf: bytes, request: RawRequest, schema: Schema, batch_size: Optional[int]) -> SparseBatch:
    """The request's KJT as views of its bytes, checked (:func:`check_sparse`)."""
    lengths = view(buf, request.lengths, "sparse.lengths", ("int32", "int64"), ndim=1)
    values = view(buf, request.values, "sparse.values", ("int64", "int32"), ndim=1)
    shared = None
    if request.shared_keys or request.shared_lengths or request.shared_values:
        shared = (request.shared_keys,
                  view(buf, request.shared_lengths, "sparse.shared_lengths", ("int32", "int64"), ndim=1),
                  view(buf, request.shared_values, "sparse.shared_values", ("int64", "int32"), ndim=1))
    return check_sparse(request.keys, lengths, values, schema, batch_size, shared)


def check_sparse(keys: Sequence[str], lengths: np.ndarray, values: Ids, schema: Schema,
                 batch_size: Optional[int], shared: Optional[Tuple[Sequence[str], np.ndarray, np.ndarray]] = None
                 ) -> SparseBatch:
    """A KJT given as arrays (``lengths`` 1-D, key-major; ``values`` 1-D), and optionally shared bags
    (``shared``: keys, lengths [S], values), checked so that no integer in it can wrap: every length
    lies in [0, number of ids] before anything is summed, and sums are int64 (at most 2**31 lengths of
    at most 2**28 ids each). Every protocol's translator ends here. ``batch_size`` None (Lookup): B
    comes from ``lengths`` (1 when only shared bags are sent)."""
    shared_keys, shared_lengths, shared_values = shared or ((), np.zeros(0, np.int64), np.zeros(0, np.int64))
    positions, shared_positions = _positions(keys, shared_keys, schema, lookup=batch_size is None)
    n_ids = values.shape[0]
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
    elif batch_size is None:
        batch_size = 1  # a Lookup of shared bags only
    _check_batch_size(batch_size, schema)
    per_key = lengths.reshape(len(keys), batch_size)
    totals = _bag_totals(per_key, n_ids, keys, "sparse.")
    if isinstance(values, IdSegments) and [p.shape[0] for p in values.parts] != totals.tolist():
        raise InvalidInput("sparse.values: a feature's lengths do not add up to its own ids")
    if shared_lengths.shape[0] != len(shared_keys):
        raise InvalidInput(f"sparse.shared_lengths: {shared_lengths.shape[0]} entries for {len(shared_keys)} shared keys")
    # One bag per shared key: its length is its total.
    shared_totals = _bag_totals(shared_lengths.reshape(-1, 1), shared_values.shape[0], shared_keys, "sparse.shared_")
    expanded = n_ids + batch_size * shared_values.shape[0]  # Python ints: cannot wrap (= expanded_ids)
    if expanded > schema.max_ids:
        shared_part = f" ({shared_values.shape[0]} shared ids count once per sample)" if shared_keys else ""
        raise InvalidInput(f"sparse.values: {expanded} ids exceed the server's limit of {schema.max_ids} "
                           f"per request{shared_part}; split the request")
    sparse = SparseBatch(keys=list(keys), positions=positions, lengths=per_key, values=values, totals=totals,
                         batch_size=batch_size,
                         in_model_order=not shared_keys and positions == schema.in_order,
                         shared_keys=list(shared_keys), shared_positions=shared_positions,
                         shared_lengths=shared_totals, shared_values=shared_values, ids_checked=False)
    if any(v.shape[0] and v.dtype.itemsize > schema.id_dtype.itemsize for v in (*_parts(values), shared_values)):
        check_ids(sparse, schema)  # before ids are narrowed to the tables' dtype, where one could wrap
    return sparse


def check_ids(sparse: SparseBatch, schema: Schema, written: Optional[np.ndarray] = None,
              stored: Optional[np.ndarray] = None, high: Optional[int] = None) -> None:
    """Every id of ``sparse`` in its table (once; InvalidInput naming the first feature that holds
    one outside). ``written``: the same ids as the front end wrote them into its shared buffer,
    ``stored`` [T] of them per model feature, in model order (the tables' dtype, no narrowing:
    :func:`check_sparse` checks first where the request's ids are wider). That copy is aligned and
    in one piece: a reduction over it costs a third of one over the request's own bytes, which sit
    wherever the client's encoding put them (numpy reduces unaligned arrays element by element).
    ``high``: the largest of them viewed unsigned, as the copy found it (serving/ipc.py
    ``write_request``). Where it finds an id outside its table, the request's own ids are looked at
    for the message."""
    if sparse.ids_checked:
        return
    if written is None or not _all_in_tables(written, stored, schema, high):
        _check_ids(sparse.values, sparse.totals, sparse.positions, sparse.keys, schema, "sparse.values")
        _check_ids(sparse.shared_values, sparse.shared_lengths, sparse.shared_positions, sparse.shared_keys, schema,
                   "sparse.shared_values")
    sparse.ids_checked = True


def _positions(keys: Sequence[str], shared_keys: Sequence[str], schema: Schema, lookup: bool
               ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Each key's feature index in the model; every key known, none sent twice (shared or not); a
    Lookup needs at least one (a Predict may send dense features alone: empty bags)."""
    if keys and not shared_keys and tuple(keys) == schema.feature_names:  # what clients send: known, each once
        return schema.in_order, ()
    index = schema.index
    if not keys and not shared_keys and lookup:
        raise InvalidInput("sparse.keys: at least one key is required")
    if len(keys) + len(shared_keys) > len(schema.feature_names):
        raise InvalidInput(f"sparse.keys: {len(keys) + len(shared_keys)} keys, the model has "
                           f"{len(schema.feature_names)} features")
    seen = set()
    for field_name, names in (("sparse.keys", keys), ("sparse.shared_keys", shared_keys)):
        for k in names:
            if k not in index:
                raise InvalidInput(f"{field_name}: unknown feature {quoted(k)}; the model has {list(schema.feature_names)}")
            if k in seen:
                raise InvalidInput(f"{field_name}: feature {quoted(k)} appears more than once")
            seen.add(k)
    return tuple(index[k] for k in keys), tuple(index[k] for k in shared_keys)


def _bag_totals(per_key: np.ndarray, n_ids: int, keys: Sequence[str], field_prefix: str) -> np.ndarray:
    """int64 [K]: ids per key, after checking each length against the ids sent (no sum can wrap)."""
    lengths_field, values_field = f"{field_prefix}lengths", f"{field_prefix}values"
    if per_key.size and int(unsigned(per_key).max()) > n_ids:  # one pass: viewed unsigned, a negative one is huge
        if per_key.min() < 0:
            k, _ = np.argwhere(per_key < 0)[0]
            raise InvalidInput(f"{lengths_field}: negative length for feature {quoted(keys[k])}")
        raise InvalidInput(f"{lengths_field}: a bag of {int(per_key.max())} ids, but {values_field} has {n_ids}")
    totals = per_key.sum(axis=1, dtype=np.int64)
    if int(totals.sum()) != n_ids:
        raise InvalidInput(f"{lengths_field} sum to {int(totals.sum())} but {values_field} has {n_ids} ids")
    return totals


def _check_ids(values: Ids, totals: np.ndarray, positions: Sequence[int], keys: Sequence[str],
               schema: Schema, field_name: str) -> None:
    """Every id of each feature in [0, its table's rows). One pass over all ids first: viewed
    unsigned, a negative id is huge, so every id is valid if the largest is below the smallest table
    sent; only a request that fails that (or sends tables of different sizes near their ends) is
    checked feature by feature, each feature's ids being one contiguous slice (or its own array)."""
    if not values.shape[0]:
        return
    rows = schema.row_counts[np.asarray(positions, np.int64)]
    sent = totals > 0
    parts = _parts(values)
    if max(int(unsigned(part).max()) for part in parts if part.shape[0]) < int(rows[sent].min()):
        return
    for k, part in enumerate(_per_key(values, totals)):
        if part.shape[0]:
            low, high = int(part.min()), int(part.max())
            if low < 0 or high >= rows[k]:
                raise InvalidInput(f"{field_name}: id {low if low < 0 else high} of feature {quoted(keys[k])} is "
                                   f"outside [0, {int(rows[k])})")


def write_checked(slot: np.ndarray, sparse: SparseBatch, kjt: ModelKJT, layout: "ipc.RequestLayout",
                  out_totals: np.ndarray, stored: np.ndarray, schema: Schema) -> None:
    """The request written into its slot of the shared buffer (:func:`serving.ipc.write_request`),
    then its ids checked on that copy (:func:`check_ids`): InvalidInput leaves the slot to the caller."""
    written, high = ipc.write_request(slot, kjt, layout, out_totals, stored, schema.id_dtype)
    check_ids(sparse, schema, written, stored, high)


def _all_in_tables(written: np.ndarray, stored: np.ndarray, schema: Schema, high: Optional[int]) -> bool:
    """Every id written (model order, ``stored`` per feature) below its table's rows, viewed unsigned
    (a negative id is huge). ``high``: the largest, as the copy found it. Where it is not below the
    smallest table, one reduction gives each feature's largest."""
    ids = unsigned(written)
    if not ids.shape[0]:
        return True
    if (int(ids.max()) if high is None else high) < schema.min_rows:
        return True
    sent = np.flatnonzero(stored)
    highs = np.maximum.reduceat(ids, (np.cumsum(stored) - stored)[sent])
    return bool((highs < schema.row_counts[sent]).all())


def _parts(values: Ids) -> List[np.ndarray]:
    return values.parts if isinstance(values, IdSegments) else [values]


def _per_key(values: Ids, totals: np.ndarray) -> List[np.ndarray]:
    """Each key's ids (views)."""
    if isinstance(values, IdSegments):
        return values.parts
    ends = np.cumsum(totals).tolist()
    return [values[start:end] for start, end in zip([0] + ends[:-1], ends)]


def model_kjt(sparse: SparseBatch, dense: Optional[np.ndarray], schema: Schema) -> ModelKJT:
    """The request in model feature order (views, no copies): each feature's ids and bag sizes."""
    t = len(schema.feature_names)
    if sparse.in_model_order:
        values = sparse.values.parts if isinstance(sparse.values, IdSegments) else sparse.values
        return ModelKJT(batch_size=sparse.batch_size, ids=[], lengths=[], dense=dense,
                        whole=(values, sparse.lengths, sparse.totals))
    ids: List[Optional[np.ndarray]] = [None] * t
    lengths: List[object] = [None] * t
    for k, (position, part) in enumerate(zip(sparse.positions, _per_key(sparse.values, sparse.totals))):
        ids[position], lengths[position] = part, sparse.lengths[k]
    start = 0
    for position, total in zip(sparse.shared_positions, sparse.shared_lengths.tolist()):
        ids[position], lengths[position] = sparse.shared_values[start:start + total], total
        start += total
    return ModelKJT(batch_size=sparse.batch_size, ids=ids, lengths=lengths, dense=dense)


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
