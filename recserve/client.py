"""A small Python client for ``recserve serve``.

    from recserve.client import Client
    with Client("127.0.0.1:50051") as c:
        ctr = c.predict("demo", dense, {"user_id": [[3], [7]], "item_id": [[1, 2], []]})
        keys, dims, pooled = c.lookup("demo", {"item_id": [[1, 2], [5]]})

Sparse features are given as a dict ``feature -> list of bags`` (one bag of ids per sample) or as
the raw KJT triple ``(keys, lengths, values)``; dense as any float array [B, F].
"""
from __future__ import annotations

import json
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from recserve import wire
from recserve.ids import UNIFORM, IdDistribution
from recserve.v1 import inference_pb2 as pb
from recserve.v1 import inference_pb2_grpc as pb_grpc

Bags = Mapping[str, Sequence[Sequence[int]]]
RawKJT = Tuple[Sequence[str], np.ndarray, np.ndarray]


def encode_sparse(sparse: Union[Bags, RawKJT]) -> pb.SparseFeatures:
    if isinstance(sparse, tuple):
        keys, lengths, values = sparse
        values = np.asarray(values)
        return pb.SparseFeatures(keys=list(keys), lengths=wire.encode(np.asarray(lengths, dtype=np.int32)),
                                 values=wire.encode(values if values.dtype in (np.int32, np.int64) else values.astype(np.int64)))
    keys = list(sparse)
    batch = {len(bags) for bags in sparse.values()}
    if len(batch) > 1:
        raise ValueError(f"every feature needs one bag per sample; got bag counts {sorted(batch)}")
    lengths = np.array([len(bag) for k in keys for bag in sparse[k]], dtype=np.int32)
    values = np.array([i for k in keys for bag in sparse[k] for i in bag], dtype=np.int64)
    return pb.SparseFeatures(keys=keys, lengths=wire.encode(lengths), values=wire.encode(values))


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

    def predict(self, model: str, dense, sparse: Union[Bags, RawKJT], version: int = 0) -> np.ndarray:
        request = pb.PredictRequest(model_name=model, model_version=version,
                                    dense=wire.encode(np.asarray(dense, dtype=np.float32)),
                                    sparse=encode_sparse(sparse))
        response = self.stub.Predict(request, timeout=self.timeout, metadata=self.metadata)
        return wire.decode(response.ctr, "ctr", ("float32",), ndim=1)

    def lookup(self, model: str, sparse: Union[Bags, RawKJT], version: int = 0) -> Tuple[List[str], List[int], np.ndarray]:
        request = pb.LookupRequest(model_name=model, model_version=version, sparse=encode_sparse(sparse))
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


def random_request(info: pb.ModelInfo, batch_size: int, mean_ids: float = 3.0,
                   seed: Optional[int] = None, ids: IdDistribution = UNIFORM) -> Tuple[np.ndarray, RawKJT]:
    """A valid random (dense, sparse) for a model, shaped from its GetModelInfo, ids drawn from
    ``ids`` (recserve/ids.py). Ids travel as int32 where every table has fewer than 2**31 rows: half
    the bytes of int64."""
    rng = np.random.default_rng(seed)
    keys = [f.name for f in info.features]
    lengths = rng.poisson(mean_ids, size=(len(keys), batch_size)).astype(np.int32)
    id_dtype = np.int32 if max(f.rows for f in info.features) < 2**31 else np.int64
    values = np.concatenate([ids.sample(rng, f.rows, int(lengths[k].sum()), k)
                             for k, f in enumerate(info.features)]).astype(id_dtype)
    dense = rng.standard_normal((batch_size, info.dense_features)).astype(np.float32)
    return dense, (keys, lengths.reshape(-1), values)
