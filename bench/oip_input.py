"""perf_analyzer's ``--input-data`` for a served model: requests of the Open Inference Protocol's tensor
contract (protos/recserve/oip/grpc_predict_v2.proto), drawn as ``recserve bench`` draws its own
(``recserve.client.random_request``: Poisson bags, valid ids). perf_analyzer takes each input's
datatype from ModelMetadata, so the ids are written in the datatype it gives (INT32 where every table
has fewer than 2**31 rows, as bench sends them over recserve.v1).

    python -m bench.oip_input --target 127.0.0.1:8001 --model v2 --batch-size 256 --out in.json
    perf_analyzer -i grpc -u 127.0.0.1:8001 -m v2 --input-data in.json \\
        --request-parameter outputs:ctr:string --concurrency-range 4
"""
from __future__ import annotations

import argparse
import base64
import json
from typing import Dict, List

import numpy as np

from recserve.client import Client, ClientError, random_request
from recserve.errors import UserError

def tensor(array: np.ndarray) -> Dict:
    """One input of a perf_analyzer data step: raw little-endian bytes (exact) and its shape."""
    return {"b64": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode(), "shape": list(array.shape)}


DTYPES = {"INT32": np.int32, "INT64": np.int64}


def step(dense: np.ndarray, keys: List[str], lengths: np.ndarray, values: np.ndarray, ids_datatype: str = "INT64",
         packed: bool = False) -> Dict:
    """One request: ``lengths`` key-major [K * B] and ``values`` as recserve.v1 carries them (every
    feature, model order); ids in ``ids_datatype`` (ModelMetadata's: perf_analyzer sends that
    datatype). A tensor per feature, or ``packed``: the inputs ``lengths`` [K, B] and ``ids``."""
    per_key = lengths.reshape(len(keys), -1)
    out = {"dense": tensor(dense)}
    if packed:
        return dict(out, lengths=tensor(per_key.astype(np.int32)), ids=tensor(values.astype(DTYPES[ids_datatype])))
    ids = np.split(values, np.cumsum(per_key.sum(axis=1))[:-1])
    for k, name in enumerate(keys):
        out[f"{name}_lengths"] = tensor(per_key[k].astype(np.int32))
        out[f"{name}_ids"] = tensor(ids[k].astype(DTYPES[ids_datatype]))
    return out


def ids_datatype(target: str, model: str, packed: bool = False) -> str:
    """The ids' datatype the server's ModelMetadata gives (its input ``ids``, or ``packed`` False: a
    feature's ``_ids``); a UserError where it lists no such input (config.json ``oip_inputs``)."""
    import grpc

    from recserve.oip import grpc_predict_v2_pb2 as oip
    from recserve.oip.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub

    with grpc.insecure_channel(target) as channel:
        metadata = GRPCInferenceServiceStub(channel).ModelMetadata(oip.ModelMetadataRequest(name=model), timeout=30)
    ids = [t.datatype for t in metadata.inputs if (t.name == "ids" if packed else t.name.endswith("_ids"))]
    if not ids:
        raise UserError(f"model {model!r} advertises the packed inputs only (dense, lengths, ids: its config.json "
                        "says \"oip_inputs\": \"packed\"), and perf_analyzer sends the inputs ModelMetadata lists: "
                        "pass --packed")
    return ids[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.oip_input", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="HOST:PORT of recserve serve (reads the model's schema)")
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--ids-per-bag", type=float, default=10.0, help="mean ids per bag (Poisson), as recserve bench")
    p.add_argument("--steps", type=int, default=4, help="distinct requests perf_analyzer cycles through")
    p.add_argument("--packed", action="store_true",
                   help="every feature in the inputs `lengths` [features, B] and `ids` (3 tensors a request)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        with Client(args.target) as c:
            info = c.model_info(args.model).models[0]
        datatype = ids_datatype(args.target, args.model, args.packed)
    except (ClientError, UserError) as e:
        p.error(str(e))
    steps = []
    for seed in range(args.steps):
        dense, (keys, lengths, values) = random_request(info, args.batch_size, args.ids_per_bag, seed=seed)
        steps.append(step(dense, keys, lengths, values, datatype, args.packed))
    with open(args.out, "w") as f:
        json.dump({"data": steps}, f)


if __name__ == "__main__":
    main()
