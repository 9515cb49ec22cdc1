"""numpy <-> ``mixrl.v1.Array``: raw little-endian bytes with a dtype and a shape.

Encoding is one ``tobytes`` copy; decoding is ``np.frombuffer`` over the message's bytes (no copy,
read-only). Decoding checks that the dtype, the rank and the byte count agree and raises
``ArrayError`` naming the field otherwise, so a malformed message never reaches numpy reshapes.
"""

from __future__ import annotations

import numpy as np

from mixrl_wire.v1 import rollout_pb2 as pb

_TO_PB = {
    np.dtype("<i4"): pb.DTYPE_INT32,
    np.dtype("<i8"): pb.DTYPE_INT64,
    np.dtype("<f4"): pb.DTYPE_FLOAT32,
    np.dtype("u1"): pb.DTYPE_UINT8,
}
_FROM_PB = {v: k for k, v in _TO_PB.items()}
DTYPE_NAMES = {v: k.name for k, v in _TO_PB.items()}


class ArrayError(ValueError):
    """A wire array is malformed; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def encode(values, dtype: str | np.dtype, out: pb.Array | None = None) -> pb.Array:
    """Encode ``values`` (array-like) as ``dtype`` into ``out`` (or a new ``Array``)."""
    dt = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).itemsize > 1 else np.dtype(dtype)
    if dt not in _TO_PB:
        raise ValueError(f"dtype {dtype} has no wire encoding (int32, int64, float32, uint8)")
    arr = np.ascontiguousarray(values, dtype=dt)
    msg = pb.Array() if out is None else out
    msg.dtype = _TO_PB[dt]
    msg.shape[:] = arr.shape
    msg.data = arr.tobytes()
    return msg


def decode(msg: pb.Array, field: str, dtype: str | np.dtype, ndim: int) -> np.ndarray:
    """Decode ``msg`` expecting ``dtype`` and rank ``ndim``; ``ArrayError(field, ...)`` if not."""
    # Each attribute access copies the bytes out of the message: read ``data`` once.
    return decode_parts(msg.dtype, tuple(msg.shape), msg.data, field, dtype, ndim)


def decode_parts(wire_dtype: int, shape: tuple[int, ...], data, field: str, dtype: str | np.dtype,
                 ndim: int) -> np.ndarray:
    """``decode`` from an array's parts (``data``: bytes or a memoryview, which is not copied)."""
    want = np.dtype(dtype)
    got = _FROM_PB.get(wire_dtype)
    if got is None or got.kind != want.kind or got.itemsize != want.itemsize:
        name = DTYPE_NAMES.get(wire_dtype, f"unknown dtype {wire_dtype}")
        raise ArrayError(field, f"dtype must be {want.name}, got {name}")
    if len(shape) != ndim:
        raise ArrayError(field, f"must have rank {ndim}, got shape {list(shape)}")
    if any(d < 0 for d in shape):
        raise ArrayError(field, f"negative dimension in shape {list(shape)}")
    n = 1
    for d in shape:
        n *= d
    if n * got.itemsize != len(data):
        raise ArrayError(field, f"shape {list(shape)} needs {n * got.itemsize} bytes of {got.name}, "
                                f"data has {len(data)}")
    return np.frombuffer(data, dtype=got).reshape(shape)
