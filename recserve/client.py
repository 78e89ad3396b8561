"""A small Python client for ``recserve serve``.

    from recserve.client import Client
    with Client("127.0.0.1:50051") as c:
        ctr = c.predict("demo", dense, {"user_id": [[3], [7]], "item_id": [[1, 2], []]})
        keys, dims, pooled = c.lookup("demo", {"item_id": [[1, 2], [5]]})
        # one user, two candidates: the user's bag travels once
        ctr = c.predict("demo", dense, {"item_id": [[1, 2], [5]]}, shared={"user_id": [3]})

Sparse features are given as a dict ``feature -> list of bags`` (one bag of ids per sample) or as
the raw KJT triple ``(keys, lengths, values)``; dense as any float array [B, F].
"""
from __future__ import annotations

import json
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from recserve import wire
from recserve.v1 import inference_pb2 as pb
from recserve.v1 import inference_pb2_grpc as pb_grpc

Bags = Mapping[str, Sequence[Sequence[int]]]
RawKJT = Tuple[Sequence[str], np.ndarray, np.ndarray]
SharedBags = Mapping[str, Sequence[int]]  # feature -> the one bag of ids of every sample


def _ids(values) -> np.ndarray:
    """Ids as they travel: int32 or int64 kept (int32 is half the bytes), anything else as int64."""
    values = np.asarray(values)
    return values if values.dtype in (np.int32, np.int64) else values.astype(np.int64)


def encode_sparse(sparse: Union[Bags, RawKJT], shared: Optional[SharedBags] = None) -> pb.SparseFeatures:
    """``sparse``: per-sample bags; ``shared``: feature -> one bag of ids for every sample of the request
    (sent once, expanded by the server)."""
    if isinstance(sparse, tuple):
        keys, lengths, values = sparse
        message = pb.SparseFeatures(keys=list(keys), lengths=wire.encode(np.asarray(lengths, dtype=np.int32)),
                                    values=wire.encode(_ids(values)))
    else:
        keys = list(sparse)
        batch = {len(bags) for bags in sparse.values()}
        if len(batch) > 1:
            raise ValueError(f"every feature needs one bag per sample; got bag counts {sorted(batch)}")
        lengths = np.array([len(bag) for k in keys for bag in sparse[k]], dtype=np.int32)
        values = np.array([i for k in keys for bag in sparse[k] for i in bag], dtype=np.int64)
        message = pb.SparseFeatures(keys=keys, lengths=wire.encode(lengths), values=wire.encode(values))
    if shared:
        bags = [_ids(bag).reshape(-1) for bag in shared.values()]
        message.shared_keys.extend(shared)
        message.shared_lengths.CopyFrom(wire.encode(np.array([len(b) for b in bags], dtype=np.int32)))
        dtype = np.int32 if all(b.dtype == np.int32 for b in bags) else np.int64
        message.shared_values.CopyFrom(wire.encode(np.concatenate(bags).astype(dtype, copy=False) if bags
                                                   else np.zeros(0, dtype)))
    return message


# Several servers: spread calls over all of them, skip those that are down, retry a call that one
# of them refused with UNAVAILABLE (queue full, shutting down) on another.
SPREAD_SERVICE_CONFIG = json.dumps({
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [{
        "name": [{"service": "recserve.v1.Inference"}],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.2s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
    }],
})


class Client:
    """``target``: "host:port", or several "host:port" (a list, or comma-separated) to balance over
    with gRPC's round_robin policy (each server health-checked by its connection state)."""

    def __init__(self, target: Union[str, Sequence[str]], timeout: Optional[float] = 10.0,
                 metadata: Optional[Sequence[Tuple[str, str]]] = None, options: Sequence = ()) -> None:
        targets = [t.strip() for t in (target.split(",") if isinstance(target, str) else target) if t.strip()]
        spread = []
        if len(targets) > 1:
            target = "ipv4:" + ",".join(targets)
            spread = [("grpc.service_config", SPREAD_SERVICE_CONFIG), ("grpc.enable_retries", 1)]
        else:
            target = targets[0]
        self.channel = grpc.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20),
            *spread, *options])
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.timeout = timeout
        self.metadata = list(metadata or [])

    def predict(self, model: str, dense, sparse: Union[Bags, RawKJT], version: int = 0,
                shared: Optional[SharedBags] = None) -> np.ndarray:
        request = pb.PredictRequest(model_name=model, model_version=version,
                                    dense=wire.encode(np.asarray(dense, dtype=np.float32)),
                                    sparse=encode_sparse(sparse, shared))
        response = self.stub.Predict(request, timeout=self.timeout, metadata=self.metadata)
        return wire.decode(response.ctr, "ctr", ("float32",), ndim=1)

    def lookup(self, model: str, sparse: Union[Bags, RawKJT], version: int = 0,
               shared: Optional[SharedBags] = None) -> Tuple[List[str], List[int], np.ndarray]:
        """(keys, dims, pooled [B, sum(dims)]): the per-sample features' columns, then the shared ones'."""
        request = pb.LookupRequest(model_name=model, model_version=version, sparse=encode_sparse(sparse, shared))
        response = self.stub.Lookup(request, timeout=self.timeout, metadata=self.metadata)
        return list(response.keys), list(response.dims), wire.decode(response.pooled, "pooled", ("float32",), ndim=2)

    def model_info(self, model: str = "") -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(model_name=model), timeout=self.timeout,
                                      metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _random_bags(rng: np.random.Generator, features: Sequence[pb.FeatureInfo], batch_size: int, mean_ids: float,
                 id_dtype) -> Tuple[np.ndarray, np.ndarray]:
    """(lengths int32 [K, B] Poisson(mean_ids), values: uniform ids of each feature's table, key-major)."""
    lengths = rng.poisson(mean_ids, size=(len(features), batch_size)).astype(np.int32)
    values = [rng.integers(0, f.rows, size=int(lengths[k].sum())) for k, f in enumerate(features)]
    return lengths, (np.concatenate(values) if values else np.zeros(0)).astype(id_dtype)


def _id_dtype(info: pb.ModelInfo):
    """Ids travel as int32 where every table has fewer than 2**31 rows: half the bytes of int64."""
    return np.int32 if max(f.rows for f in info.features) < 2**31 else np.int64


def random_request(info: pb.ModelInfo, batch_size: int, mean_ids: float = 3.0,
                   seed: Optional[int] = None) -> Tuple[np.ndarray, RawKJT]:
    """A valid random (dense, sparse) for a model, shaped from its GetModelInfo."""
    rng = np.random.default_rng(seed)
    lengths, values = _random_bags(rng, info.features, batch_size, mean_ids, _id_dtype(info))
    dense = rng.standard_normal((batch_size, info.dense_features)).astype(np.float32)
    return dense, ([f.name for f in info.features], lengths.reshape(-1), values)


def ranking_request(info: pb.ModelInfo, batch_size: int, shared_features: Sequence[str], mean_ids: float = 3.0,
                    shared_mean_ids: float = 50.0, seed: Optional[int] = None
                    ) -> Tuple[np.ndarray, RawKJT, Dict[str, np.ndarray]]:
    """A valid random ranking request: one user, ``batch_size`` candidates. (dense, the per-sample
    features' KJT, {shared feature: its one bag}); shared bags hold Poisson(``shared_mean_ids``) ids."""
    rng = np.random.default_rng(seed)
    dtype = _id_dtype(info)
    shared_set = set(shared_features)
    per_sample = [f for f in info.features if f.name not in shared_set]
    shared = [f for f in info.features if f.name in shared_set]
    lengths, values = _random_bags(rng, per_sample, batch_size, mean_ids, dtype)
    shared_lengths, shared_values = _random_bags(rng, shared, 1, shared_mean_ids, dtype)
    bags = dict(zip((f.name for f in shared), np.split(shared_values, np.cumsum(shared_lengths[:, 0])[:-1])))
    dense = rng.standard_normal((batch_size, info.dense_features)).astype(np.float32)
    return dense, ([f.name for f in per_sample], lengths.reshape(-1), values), bags


def repeat_shared(sparse: RawKJT, shared: Mapping[str, np.ndarray], batch_size: int) -> RawKJT:
    """The per-sample form of a request with shared bags: each shared bag repeated for every sample."""
    keys, lengths, values = sparse
    bags = [np.asarray(bag) for bag in shared.values()]
    lengths = np.concatenate([np.asarray(lengths, np.int32)] + [np.full(batch_size, len(b), np.int32) for b in bags])
    values = np.concatenate([np.asarray(values)] + [np.tile(b, batch_size) for b in bags])
    return list(keys) + list(shared), lengths, values


def shared_feature_names(spec: str, info: pb.ModelInfo) -> Tuple[str, ...]:
    """``--shared-features``: a count N (the model's first N features) or comma-separated names."""
    names = [f.name for f in info.features]
    if spec.strip().isdigit():
        n = int(spec)
        if n >= len(names):
            raise ValueError(f"--shared-features {n}: the model has {len(names)} features; at least one must stay "
                             "per-sample")
        return tuple(names[:n])
    chosen = tuple(s.strip() for s in spec.split(",") if s.strip())
    unknown = [c for c in chosen if c not in names]
    if unknown:
        raise ValueError(f"--shared-features: unknown features {unknown}; the model has {names}")
    return chosen
