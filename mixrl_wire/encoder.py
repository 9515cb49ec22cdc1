"""Encoding of ``mixrl.v1.Trajectory`` straight from numpy arrays: the mirror of ``fastpath``.

Building a protobuf message copies every array into an ``Array`` (``tobytes``, then into the
message's arena) and ``SerializeToString`` copies it all once more: for a 4,096-token trajectory
with a K=20 head that is over a millisecond of sampler CPU per sample. ``encode_fields`` writes
the wire format itself (tag, varint length, raw little-endian bytes per ``Array`` submessage) and
joins it in one copy of the arrays; ``encode_trajectory`` is the sampler-facing form (a leased
task and per-token arrays in, an ``EncodedTrajectory`` out). This is the only trajectory encoder:
a caller that wants a message parses the bytes (``build_trajectory``).

The output is what the protobuf runtime serializes for the same message, byte for byte: fields in
number order, proto3 defaults (empty strings, zero integers, +0.0 doubles) omitted, ``reward`` and
the embedded messages written whenever set, even when empty.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Mapping

import numpy as np

from mixrl_wire import TRAJECTORY_ARRAY_FIELDS, pb

_WIRE_DTYPES = {np.dtype("<i4"): pb.DTYPE_INT32, np.dtype("<i8"): pb.DTYPE_INT64,
                np.dtype("<f4"): pb.DTYPE_FLOAT32, np.dtype("u1"): pb.DTYPE_UINT8}
_F32 = struct.Struct("<f")
_F64 = struct.Struct("<d")
_U64 = 0xFFFFFFFFFFFFFFFF
_ZERO8 = bytes(8)  # +0.0: a proto3 double at its default (-0.0 is written)
_ZERO4 = bytes(4)  # +0.0 as a proto3 float


def varint(value: int) -> bytes:
    """``value`` (already reduced to an unsigned 64-bit integer) as a protobuf varint."""
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(num: int, wire_type: int) -> bytes:
    return varint((num << 3) | wire_type)


_KEYS = {num: _key(num, 2) for num in range(1, 19)}


def _len_field(num: int, payload: bytes) -> bytes:
    return _KEYS[num] + varint(len(payload)) + payload


def string_field(num: int, text: str) -> bytes:
    """A proto3 ``string`` field; empty (the default) is omitted."""
    return _len_field(num, text.encode("utf-8")) if text else b""


def array_parts(num: int, arr: np.ndarray) -> list:
    """The wire parts of ``Array`` field ``num`` holding ``arr`` (C-contiguous, a wire dtype).

    The last part is ``arr`` itself (its buffer is copied only when the parts are joined).
    """
    wire_dtype = _WIRE_DTYPES.get(arr.dtype)
    if wire_dtype is None:
        raise ValueError(f"dtype {arr.dtype} has no wire encoding (int32, int64, float32, uint8)")
    if not arr.flags.c_contiguous:
        raise ValueError("arrays must be C-contiguous")
    head = bytearray(b"\x08")
    head += varint(wire_dtype)
    if arr.ndim:
        dims = b"".join(varint(d) for d in arr.shape)
        head += b"\x12" + varint(len(dims)) + dims
    if arr.nbytes:
        head += b"\x1a" + varint(arr.nbytes)
    return [_KEYS[num], varint(len(head) + arr.nbytes), bytes(head), arr]


def _f32(x: float) -> bytes:
    try:
        return _F32.pack(x)
    except OverflowError:  # the runtime stores a float field with a C cast: out of range -> inf
        return _F32.pack(math.copysign(math.inf, x))


def encode_fields(*, session_id: str = "", lease_id: str = "", task_id: int = 0, sample_index: int = 0,
                  arrays: Mapping[str, np.ndarray], reward: float | None = None,
                  finish_reason: str = "", timings: tuple[float, float] | None = (0.0, 0.0),
                  reward_parts: Mapping[str, float] | None = None) -> bytes:
    """A serialized ``mixrl.v1.Trajectory``.

    ``arrays``: field name -> C-contiguous array of its wire dtype (int32, int64, float32, uint8);
    absent names are unset fields. ``timings``: ``(queue_ms, generate_ms)``, or ``None`` to leave
    the ``Timings`` message unset. ``reward_parts``: name -> value, one ``RewardPart`` each.
    """
    if not 0 <= task_id < 2**64:
        raise ValueError(f"task_id {task_id} is not a uint64")
    if not -2**31 <= sample_index < 2**31:
        raise ValueError(f"sample_index {sample_index} is not an int32")
    parts: list = [string_field(1, session_id), string_field(2, lease_id)]
    if task_id:
        parts.append(b"\x18" + varint(int(task_id) & _U64))
    if sample_index:
        parts.append(b"\x20" + varint(int(sample_index) & _U64))
    unknown = set(arrays) - TRAJECTORY_ARRAY_FIELDS.keys()
    if unknown:
        raise ValueError(f"not Trajectory array fields: {sorted(unknown)}")
    for name, num in TRAJECTORY_ARRAY_FIELDS.items():
        arr = arrays.get(name)
        if arr is not None:
            parts += array_parts(num, arr)
    if reward is not None:
        parts.append(b"\x7d" + _f32(float(reward)))
    parts.append(string_field(16, finish_reason))
    if timings is not None:
        packed = [(tag, _F64.pack(v)) for tag, v in zip((b"\x09", b"\x11"), timings, strict=True)]
        parts.append(_len_field(17, b"".join(tag + v for tag, v in packed if v != _ZERO8)))
    for name, value in (reward_parts or {}).items():
        # a proto3 float of +0.0 is not written (the runtime's encoding, byte for byte)
        value_field = b"" if _f32(float(value)) == _ZERO4 else b"\x15" + _f32(float(value))
        parts.append(_len_field(18, string_field(1, str(name)) + value_field))
    return b"".join(parts)


# ------------------------------------------------------------------------------------------------
# Sampler-facing: a leased task and per-token arrays in, wire bytes out


def support_csr(support_ids, support_logprobs, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR (indptr, ids, logprobs) from ragged rows or from rows padded with -1 ids / -inf logprobs."""
    if isinstance(support_ids, np.ndarray) and support_ids.ndim == 2:
        ids = np.asarray(support_ids)
        lps = np.asarray(support_logprobs, dtype=np.float32)
        keep = ids >= 0
        lengths = keep.sum(axis=1)
        return (np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
                ids[keep].astype(np.int32), lps[keep])
    rows_ids = [np.asarray(r) for r in support_ids]
    rows_lps = [np.asarray(r, dtype=np.float32) for r in support_logprobs]
    if len(rows_ids) != n:
        raise ValueError(f"support has {len(rows_ids)} rows for {n} policy tokens")
    keep = [r >= 0 for r in rows_ids]  # tolerate padded rows given as a list too
    ids = [r[k] for r, k in zip(rows_ids, keep, strict=True)]
    lps = [r[k] for r, k in zip(rows_lps, keep, strict=True)]
    lengths = np.array([len(r) for r in ids], dtype=np.int64)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cat = lambda rows, dt: np.concatenate(rows).astype(dt) if rows else np.zeros(0, dt)
    return indptr, cat(ids, np.int32), cat(lps, np.float32)


@dataclasses.dataclass(frozen=True)
class EncodedTrajectory:
    """A ``Trajectory`` already serialized (``encode_trajectory``): submitted without re-encoding.

    ``data`` is the message for ``session_id``; ``for_session`` rewrites only that leading field
    when the client's session changed (a re-registration) since it was encoded.
    """

    task_id: int
    sample_index: int
    data: bytes
    session_id: str = ""

    def for_session(self, session_id: str) -> bytes:
        """The wire bytes with ``session_id`` (field 1, which the encoder writes first)."""
        if session_id == self.session_id:
            return self.data
        old = len(string_field(1, self.session_id))
        return string_field(1, session_id) + memoryview(self.data)[old:]

    def to_message(self) -> pb.Trajectory:
        """The same trajectory as a protobuf message (for inspection; not on the hot path)."""
        return pb.Trajectory.FromString(self.data)

    def __len__(self) -> int:
        return len(self.data)


def _wire_array(values, dtype: str) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<"))


def encode_trajectory(task: pb.Task, sample_index: int, *, token_ids, logprobs, logprobs_full, versions,
                      head_ids, head_logprobs, loss_mask=None, support_ids=None, support_logprobs=None,
                      reward: float | None = None, finish_reason: str = "", queue_ms: float = 0.0,
                      generate_ms: float = 0.0, session_id: str = "",
                      reward_parts: Mapping[str, float] | None = None) -> EncodedTrajectory:
    """The trajectory of sample ``sample_index`` of a leased ``task``, as wire bytes.

    ``token_ids``: all tokens after the prompt; ``loss_mask`` (default: all policy tokens) marks
    which the policy generated, and the per-token arrays are aligned with those. ``support_*``:
    only when the task's sampling truncates; ragged rows, or rows padded with -1 / -inf. Inputs of
    other dtypes (int64, bool, float64, lists) are cast; each array is copied once. Pass the
    client's ``session_id`` to save the copy that ``submit`` otherwise makes to insert it.
    """
    tokens = _wire_array(token_ids, "int32")
    mask = np.ones(tokens.shape, np.uint8) if loss_mask is None else _wire_array(loss_mask, "uint8")
    arrays = {"token_ids": tokens, "loss_mask": mask, "logprobs": _wire_array(logprobs, "float32"),
              "logprobs_full": _wire_array(logprobs_full, "float32"),
              "versions": _wire_array(versions, "int32"), "head_ids": _wire_array(head_ids, "int32"),
              "head_logprobs": _wire_array(head_logprobs, "float32")}
    if support_ids is not None:
        indptr, ids, lps = support_csr(support_ids, support_logprobs, int(mask.sum()))
        arrays.update(support_indptr=_wire_array(indptr, "int32"), support_ids=_wire_array(ids, "int32"),
                      support_logprobs=_wire_array(lps, "float32"))
    data = encode_fields(session_id=session_id, lease_id=task.lease_id, task_id=task.task_id,
                         sample_index=sample_index, arrays=arrays,
                         reward=None if reward is None else float(reward),
                         finish_reason=finish_reason, timings=(float(queue_ms), float(generate_ms)),
                         reward_parts=reward_parts)
    return EncodedTrajectory(task.task_id, sample_index, data, session_id)


def build_trajectory(task: pb.Task, sample_index: int, **kwargs) -> pb.Trajectory:
    """``encode_trajectory``'s trajectory as a protobuf message, for callers that edit fields
    (tests corrupting one) or want a message API; parsed from the bytes, so there is one encoder.
    Submitting the ``EncodedTrajectory`` itself is cheaper."""
    return encode_trajectory(task, sample_index, **kwargs).to_message()


def size_bound(traj: pb.Trajectory) -> int:
    """An upper bound of ``traj``'s serialized size, without ``ByteSize()`` (as slow as serializing).

    Array payloads and strings are exact; 1 KiB covers every tag, length prefix, shape and scalar.
    """
    return (1024 + sum(len(getattr(traj, f).data) for f in TRAJECTORY_ARRAY_FIELDS)
            + len(traj.session_id) + len(traj.lease_id) + len(traj.finish_reason.encode()))
