"""numpy arrays <-> ``recserve.v1.Tensor`` (raw little-endian bytes, C order).

Decoding views the message's bytes in place (``np.frombuffer``): no copy, memory speed.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np

from recserve.v1 import inference_pb2 as pb

DTYPES = {
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
}


class WireError(ValueError):
    """A Tensor message that does not describe a valid array; str() names the field."""


def encode(array: np.ndarray) -> pb.Tensor:
    array = np.asarray(array)
    name = array.dtype.name
    if name not in DTYPES:
        raise WireError(f"dtype {name} cannot travel; use one of {sorted(DTYPES)}")
    array = np.ascontiguousarray(array, dtype=DTYPES[name])
    return pb.Tensor(dtype=name, shape=list(array.shape), data=array.tobytes())


def view(buffer, start: int, end: int, dtype_name: str, shape: Sequence[int], field: str,
         allowed: Iterable[str], ndim: Optional[int] = None) -> np.ndarray:
    """A read-only view of ``buffer[start:end]`` as an array of ``dtype_name`` and ``shape``, checked
    for dtype, rank, dimensions and byte count; WireError (naming ``field``) otherwise."""
    allowed = tuple(allowed)
    if not dtype_name and start == end and not shape:  # a tensor field not sent (protobuf's default)
        raise WireError(f"{field}: missing; send a tensor of dtype {' or '.join(allowed)}")
    if dtype_name not in allowed:
        raise WireError(f"{field}: dtype {dtype_name!r} not accepted; expected one of {list(allowed)}")
    shape = tuple(shape)
    if ndim is not None and len(shape) != ndim:
        raise WireError(f"{field}: expected {ndim} dimension(s), got shape {list(shape)}")
    if any(d < 0 for d in shape):
        raise WireError(f"{field}: negative dimension in shape {list(shape)}")
    dtype = DTYPES[dtype_name]
    count = 1
    for d in shape:
        count *= d
    if count * dtype.itemsize != end - start:
        raise WireError(f"{field}: shape {list(shape)} of {dtype_name} needs {count * dtype.itemsize} bytes, "
                        f"data has {end - start}")
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=start).reshape(shape)


def decode(tensor: pb.Tensor, field: str, allowed: Iterable[str], ndim: Optional[int] = None) -> np.ndarray:
    """A read-only view of the message's bytes (read once: upb copies a bytes field on every access)."""
    data = tensor.data
    return view(data, 0, len(data), tensor.dtype, tensor.shape, field, allowed, ndim)
