"""A front end's own work on one request, per protocol, on this machine's CPU: the same request as
recserve.v1 bytes (one KJT) and as OIP bytes (one tensor per feature, raw contents, as perf_analyzer
sends it; the packed form, every feature in ``lengths`` and ``ids``; and the packed form's tensors in
a system shared memory region, as perf_analyzer --shared-memory system sends them), read and
checked, then also written into a slot of the shared buffer (ids checked there).
No server, no transport: what `recserve serve` adds per request before the engine, per protocol.

    python -m bench.decode [--batch-sizes 256,4096] [--features 26] [--rows 250000] [--ids-per-bag 10]
                           [--shared-features 13 --shared-ids-per-bag 50]

prints one row per batch size and step (median of --repeats runs of --number requests each, in ms).
With --shared-features N, two more rows: a ranking request (recserve.v1) whose first N features are
one bag per request (Poisson(--shared-ids-per-bag) ids, sent once) and the others per sample.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import timeit
from contextlib import contextmanager
from typing import BinaryIO, Callable, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

from recserve import wire as recserve_wire
from recserve.client import encode_sparse, ranking_request as client_ranking_request
from recserve.oip import grpc_predict_v2_pb2 as oip
from recserve.v1 import inference_pb2 as pb
from serving import ipc
from serving.frontend import protowire
from serving.frontend.oip import wire as oip_wire
from serving.frontend.oip.shm import BYTE_SIZE, OFFSET, REGION, SharedMemory
from serving.frontend.oip.protocol import expected_inputs, to_batch
from serving.frontend.validate import decode_predict, model_kjt, write_checked

DENSE = 13


def requests(schema: ipc.Schema, batch_size: int, ids_per_bag: float, seed: int = 0) -> Tuple[bytes, bytes, bytes]:
    """The same request as (recserve.v1 PredictRequest, OIP ModelInferRequest asking for ctr with a
    tensor per feature, the same with the features packed in ``lengths`` and ``ids``) bytes."""
    rng = np.random.default_rng(seed)
    t = len(schema.feature_names)
    lengths = rng.poisson(ids_per_bag, (t, batch_size)).astype(np.int32)
    ends = np.cumsum(lengths.sum(axis=1))
    values = np.concatenate([rng.integers(0, rows, n) for rows, n in zip(schema.rows, lengths.sum(axis=1))])
    values = values.astype(schema.id_dtype)
    dense = rng.standard_normal((batch_size, schema.dense_features)).astype(np.float32)
    v1 = pb.PredictRequest(model_name="m", dense=recserve_wire.encode(dense),
                           sparse=encode_sparse((list(schema.feature_names), lengths.reshape(-1), values)))
    ids_type = "INT32" if schema.id_dtype == np.int32 else "INT64"
    tensors = [("dense", "FP32", dense)]
    for k, name in enumerate(schema.feature_names):
        tensors += [(f"{name}_lengths", "INT32", lengths[k]),
                    (f"{name}_ids", ids_type, values[ends[k] - lengths[k].sum():ends[k]])]
    packed = [("dense", "FP32", dense), ("lengths", "INT32", lengths), ("ids", ids_type, values)]
    return v1.SerializeToString(), oip_request(tensors), oip_request(packed)


def ranking_request(schema: ipc.Schema, batch_size: int, ids_per_bag: float, shared_features: int,
                    shared_ids_per_bag: float, seed: int = 0) -> bytes:
    """A recserve.v1 PredictRequest whose first ``shared_features`` features are one bag for every
    sample, as `recserve bench --shared-features` makes it (recserve.client.ranking_request)."""
    info = pb.ModelInfo(features=[pb.FeatureInfo(name=name, rows=rows) for name, rows in zip(schema.feature_names,
                                                                                              schema.rows)],
                        dense_features=schema.dense_features)
    dense, sparse, shared = client_ranking_request(info, batch_size, schema.feature_names[:shared_features],
                                                   ids_per_bag, shared_ids_per_bag, seed)
    return pb.PredictRequest(model_name="m", dense=recserve_wire.encode(dense),
                             sparse=encode_sparse(sparse, shared)).SerializeToString()


def oip_request(tensors) -> bytes:
    request = oip.ModelInferRequest(model_name="m")
    request.parameters["outputs"].string_param = "ctr"
    for name, datatype, array in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        request.raw_input_contents.append(array.tobytes())
    return request.SerializeToString()


def place_in_region(request, region: str, file: BinaryIO, chosen: Optional[Sequence[bool]] = None) -> int:
    """Move the chosen inputs' raw contents (every input's by default) of an OIP ModelInferRequest
    into ``file`` (an open /dev/shm object), one after another from its start, and name ``region``
    in their parameters, as perf_analyzer --shared-memory system sends them; the bytes placed."""
    kept, offset = [], 0
    for i, (tensor, raw) in enumerate(zip(request.inputs, request.raw_input_contents)):
        if chosen is not None and not chosen[i]:
            kept.append(raw)
            continue
        file.seek(offset)
        file.write(raw)
        tensor.parameters[REGION].string_param = region
        tensor.parameters[BYTE_SIZE].int64_param = len(raw)
        tensor.parameters[OFFSET].int64_param = offset
        offset += len(raw)
    del request.raw_input_contents[:]
    request.raw_input_contents.extend(kept)
    return offset


@contextmanager
def in_shared_memory(packed_bytes: bytes) -> Iterator[Tuple[SharedMemory, bytes]]:
    """The packed request with its tensors moved into a registered system shared memory region (a
    /dev/shm object, removed after): (the front end's view of the regions, the request bytes)."""
    request = oip.ModelInferRequest.FromString(packed_bytes)
    key = f"recserve_bench_decode_{os.getpid()}"
    with open(f"/dev/shm/{key}", "wb") as f:
        size = place_in_region(request, "inputs", f)
    try:
        with tempfile.TemporaryDirectory() as directory:
            shared = SharedMemory(directory)
            shared.register("inputs", "/" + key, 0, size)
            yield shared, request.SerializeToString()
    finally:
        os.unlink(f"/dev/shm/{key}")


def steps(schema: ipc.Schema, v1: bytes, oip_bytes: bytes, packed_bytes: bytes,
          shm: Optional[Tuple[SharedMemory, bytes]] = None, ranking: Optional[bytes] = None
          ) -> Dict[str, Callable[[], object]]:
    """Each step's call; ``shm``: in_shared_memory's (regions, request), for the shared-memory rows;
    ``ranking``: a recserve.v1 request with shared bags (:func:`ranking_request`), for its rows."""
    slot = np.zeros(64 << 20, np.uint8)

    def v1_reader(body: bytes):
        return lambda: decode_predict(body, protowire.parse_request(body, predict=True), schema)
    v1_read = v1_reader(v1)

    def oip(body: bytes, *shared: SharedMemory):
        def read():
            request = oip_wire.parse_infer(body)
            return to_batch(oip_wire.arrays(body, request, expected_inputs(schema), *shared), schema, need_dense=True)
        return read

    def written(read):
        def run():
            dense, sparse = read()
            kjt = model_kjt(sparse, dense, schema)
            layout, out_totals, stored = ipc.layout_of(kjt, schema, False, lookup=False)
            write_checked(slot[:layout.block_bytes], sparse, kjt, layout, out_totals, stored, schema)
        return run

    reads = {"OIP read": oip(oip_bytes), "OIP packed read": oip(packed_bytes)}
    if shm is not None:
        reads["OIP shm read"] = oip(shm[1], shm[0])
    shared = {} if ranking is None else {"v1 shared read": v1_reader(ranking)}
    return {"recserve.v1 read": v1_read, **reads, **shared, "recserve.v1 read+write": written(v1_read),
            **{f"{name}+write": written(read) for name, read in {**reads, **shared}.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="256,4096")
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--rows", type=int, default=250_000, help="rows of every table")
    p.add_argument("--ids-per-bag", type=float, default=10.0)
    p.add_argument("--shared-features", type=int, default=0,
                   help="also time a ranking request whose first N features are shared bags")
    p.add_argument("--shared-ids-per-bag", type=float, default=50.0)
    p.add_argument("--number", type=int, default=200, help="requests per timed run")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes: comma-separated integers, got {args.batch_sizes!r}")
    if min(batches) < 1 or args.features < 1 or args.rows < 1 or args.number < 1 or args.repeats < 1:
        p.error("--batch-sizes, --features, --rows, --number and --repeats must be >= 1")
    for flag, mean in (("--ids-per-bag", args.ids_per_bag), ("--shared-ids-per-bag", args.shared_ids_per_bag)):
        if not 0 <= mean < float("inf"):
            p.error(f"{flag} must be >= 0 (a mean number of ids), got {mean:g}")
    if not 0 <= args.shared_features <= args.features:
        p.error(f"--shared-features must be between 0 and --features ({args.features}), got {args.shared_features}")
    schema = ipc.Schema(tuple(f"f{i}" for i in range(args.features)), (args.rows,) * args.features,
                        (128,) * args.features, DENSE, max(batches), 1 << 28)
    print(f"{'batch':>6} {'step':<24} {'ms per request':>15} {'OIP / v1':>9}")
    for b in batches:
        timed = {}
        v1, per_feature, packed = requests(schema, b, args.ids_per_bag)
        ranking = ranking_request(schema, b, args.ids_per_bag, args.shared_features, args.shared_ids_per_bag) \
            if args.shared_features else None
        with in_shared_memory(packed) as shm:
            for name, run in steps(schema, v1, per_feature, packed, shm, ranking).items():
                run()
                times = timeit.repeat(run, number=args.number, repeat=args.repeats)
                timed[name] = float(np.median(times)) / args.number * 1000
        for name, ms in timed.items():
            ratio = f"{ms / timed['recserve.v1 ' + name.rsplit(' ', 1)[1]]:.2f}x" if name.startswith("OIP") else ""
            print(f"{b:>6} {name:<24} {ms:>15.3f} {ratio:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
