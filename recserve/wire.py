"""numpy arrays <-> ``recserve.v1.Tensor`` (raw little-endian bytes, C order).

Decoding views the message's bytes in place (``np.frombuffer``): no copy, memory speed.
"""
from __future__ import annotations

from typing import Iterable, Optional

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


def decode(
    tensor: pb.Tensor,
    field: str,
    allowed: Iterable[str],
    ndim: Optional[int] = None,
) -> np.ndarray:
    """A read-only view of the message's bytes, checked for dtype, rank and byte count."""
    allowed = tuple(allowed)
    if tensor.dtype not in allowed:
        raise WireError(f"{field}: dtype {tensor.dtype!r} not accepted; expected one of {list(allowed)}")
    shape = tuple(tensor.shape)
    if ndim is not None and len(shape) != ndim:
        raise WireError(f"{field}: expected {ndim} dimension(s), got shape {list(shape)}")
    if any(d < 0 for d in shape):
        raise WireError(f"{field}: negative dimension in shape {list(shape)}")
    dtype = DTYPES[tensor.dtype]
    count = 1
    for d in shape:
        count *= d
    if count * dtype.itemsize != len(tensor.data):
        raise WireError(
            f"{field}: shape {list(shape)} of {tensor.dtype} needs {count * dtype.itemsize} bytes, "
            f"data has {len(tensor.data)}"
        )
    return np.frombuffer(tensor.data, dtype=dtype).reshape(shape)
