"""perf_analyzer's ``--input-data`` for a served model: requests of the Open Inference Protocol's tensor
contract (protos/recserve/oip/grpc_predict_v2.proto), drawn as ``recserve bench`` draws its own
(``recserve.client.random_request``: Poisson bags, valid ids; ids travel as INT64, the contract's
datatype, where bench sends int32: perf_analyzer takes each input's datatype from ModelMetadata).

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

from recserve.client import Client, random_request

def tensor(array: np.ndarray) -> Dict:
    """One input of a perf_analyzer data step: raw little-endian bytes (exact) and its shape."""
    return {"b64": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode(), "shape": list(array.shape)}


def step(dense: np.ndarray, keys: List[str], lengths: np.ndarray, values: np.ndarray) -> Dict:
    """One request: ``lengths`` key-major [K * B] and ``values`` as recserve.v1 carries them."""
    per_key = lengths.reshape(len(keys), -1)
    ids = np.split(values, np.cumsum(per_key.sum(axis=1))[:-1])
    out = {"dense": tensor(dense)}
    for k, name in enumerate(keys):
        out[f"{name}_lengths"] = tensor(per_key[k].astype(np.int32))
        out[f"{name}_ids"] = tensor(ids[k].astype(np.int64))  # perf_analyzer sends the datatype ModelMetadata gives
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="HOST:PORT of recserve serve (reads the model's schema)")
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--ids-per-bag", type=float, default=10.0, help="mean ids per bag (Poisson), as recserve bench")
    p.add_argument("--steps", type=int, default=4, help="distinct requests perf_analyzer cycles through")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    with Client(args.target) as c:
        info = c.model_info(args.model).models[0]
    steps = []
    for seed in range(args.steps):
        dense, (keys, lengths, values) = random_request(info, args.batch_size, args.ids_per_bag, seed=seed)
        steps.append(step(dense, keys, lengths, values))
    with open(args.out, "w") as f:
        json.dump({"data": steps}, f)


if __name__ == "__main__":
    main()
