"""Zero-copy decoding of ``mixrl.v1.Trajectory`` for the service's hot path.

The protobuf runtime copies a message's bytes into its arena when parsing and copies each
``bytes`` field out again on every access: for a 4,096-token trajectory with a K=20 head that is
1.5 MB of copying per sample, on the server's single interpreter lock. ``parse_trajectory`` walks
the wire format once and returns ``memoryview`` slices of the received buffer instead, so the
arrays the validator checks (and the trainer later reads) are views of the bytes gRPC delivered.

Only the well-formed common case is decoded here: any field repeated where protobuf would merge
(an embedded message sent twice), a group wire type, or a malformed varint makes it return
``None``, and the caller falls back to the protobuf runtime, which defines the semantics.
"""

from __future__ import annotations

import dataclasses
import struct

from mixrl_wire import TRAJECTORY_ARRAY_FIELDS, pb

# Field number -> name: the decoder meets numbers on the wire.
_ARRAY_FIELDS = {num: name for name, num in TRAJECTORY_ARRAY_FIELDS.items()}
_F32 = struct.Struct("<f")
_F64 = struct.Struct("<d")
_MAX_FIELD = (1 << 29) - 1  # the largest field number protobuf allows


@dataclasses.dataclass
class WireArray:
    dtype: int
    shape: tuple[int, ...]
    data: memoryview


@dataclasses.dataclass
class WireTrajectory:
    """The fields of a ``Trajectory``, arrays as views of the received bytes."""

    session_id: str = ""
    lease_id: str = ""
    task_id: int = 0
    sample_index: int = 0
    arrays: dict[str, WireArray] = dataclasses.field(default_factory=dict)
    reward: float | None = None
    finish_reason: str = ""
    queue_ms: float = 0.0
    generate_ms: float = 0.0
    reward_parts: list[tuple[str, float]] = dataclasses.field(default_factory=list)


class _Malformed(Exception):
    pass


def _varint(buf, i: int, end: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= end or shift > 63:
            raise _Malformed
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def _fields(buf, i: int, end: int) -> list[tuple[int, int, object]]:
    """``(field number, wire type, value)`` of every field in ``buf[i:end]``; LEN values as
    ``(start, stop)``. One-byte varints (every key up to field 15, and most lengths and shape
    entries) are read inline: the Python call per varint was most of the decoder's time."""
    out = []
    append = out.append
    while i < end:
        key = buf[i]
        if key < 0x80:
            i += 1
        else:
            key, i = _varint(buf, i, end)
            if key >> 3 > _MAX_FIELD:  # protobuf refuses such a tag (hypothesis found one)
                raise _Malformed
        num, wt = key >> 3, key & 7
        if num == 0:
            raise _Malformed
        if wt == 2:
            if i >= end:
                raise _Malformed
            n = buf[i]
            if n < 0x80:
                i += 1
            else:
                n, i = _varint(buf, i, end)
            if i + n > end:
                raise _Malformed
            append((num, 2, (i, i + n)))
            i += n
        elif wt == 0:
            if i >= end:
                raise _Malformed
            val = buf[i]
            if val < 0x80:
                i += 1
            else:
                val, i = _varint(buf, i, end)
            append((num, 0, val))
        elif wt == 5:
            if i + 4 > end:
                raise _Malformed
            append((num, 5, (i, i + 4)))
            i += 4
        elif wt == 1:
            if i + 8 > end:
                raise _Malformed
            append((num, 1, (i, i + 8)))
            i += 8
        else:  # groups (3, 4) and invalid types
            raise _Malformed
    return out


def _int64(v: int) -> int:
    v &= 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v >= 1 << 63 else v


def _int32(v: int) -> int:
    """An int32 field (or enum): protobuf keeps the low 32 bits, signed."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _array(buf, view: memoryview, start: int, stop: int) -> WireArray:
    dtype, shape, data = 0, [], view[0:0]
    for num, wt, val in _fields(buf, start, stop):
        if num == 1 and wt == 0:
            dtype = _int32(val)
        elif num == 2 and wt == 0:
            shape.append(_int64(val))
        elif num == 2 and wt == 2:  # packed
            j, e = val
            while j < e:
                d = buf[j]
                if d < 0x80:
                    j += 1
                else:
                    d, j = _varint(buf, j, e)
                shape.append(_int64(d))
        elif num == 3 and wt == 2:
            data = view[val[0]:val[1]]
        elif num in (1, 2, 3):
            raise _Malformed  # a known field with the wrong wire type
    return WireArray(dtype, tuple(shape), data)


def parse_trajectory(data: bytes) -> WireTrajectory | None:
    """Decode ``data`` without copying arrays; ``None`` if the runtime must handle it."""
    view = memoryview(data)
    # Varints are read by indexing: bytes index faster than a memoryview (arrays are still
    # sliced from the view, never copied).
    buf = data if isinstance(data, bytes) else view
    t = WireTrajectory()
    seen_messages: set[int] = set()
    try:
        for num, wt, val in _fields(buf, 0, len(view)):
            if num in _ARRAY_FIELDS or num == 17:
                if wt != 2 or num in seen_messages:
                    return None  # protobuf merges repeated embedded messages: leave that to it
                seen_messages.add(num)
                if num == 17:
                    t.queue_ms, t.generate_ms = _timings(view, *val)
                else:
                    t.arrays[_ARRAY_FIELDS[num]] = _array(buf, view, *val)
            elif num in (1, 2, 16) and wt == 2:
                text = str(view[val[0]:val[1]], "utf-8")
                if num == 1:
                    t.session_id = text
                elif num == 2:
                    t.lease_id = text
                else:
                    t.finish_reason = text
            elif num == 3 and wt == 0:
                t.task_id = val & 0xFFFFFFFFFFFFFFFF
            elif num == 4 and wt == 0:
                t.sample_index = _int32(val)
            elif num == 15 and wt == 5:
                t.reward = _F32.unpack_from(view, val[0])[0]
            elif num == 18 and wt == 2:
                t.reward_parts.append(_reward_part(view, *val))
            elif num <= 18:
                return None  # a known field with an unexpected wire type
    except (_Malformed, UnicodeDecodeError):
        return None
    return t


def _reward_part(buf: memoryview, start: int, stop: int) -> tuple[str, float]:
    name, value = "", 0.0
    for num, wt, val in _fields(buf, start, stop):
        if num == 1 and wt == 2:
            name = str(buf[val[0]:val[1]], "utf-8")
        elif num == 2 and wt == 5:
            value = _F32.unpack_from(buf, val[0])[0]
        elif num in (1, 2):
            raise _Malformed
    return name, value


def _timings(buf: memoryview, start: int, stop: int) -> tuple[float, float]:
    q = g = 0.0
    for num, wt, val in _fields(buf, start, stop):
        if num == 1 and wt == 1:
            q = _F64.unpack_from(buf, val[0])[0]
        elif num == 2 and wt == 1:
            g = _F64.unpack_from(buf, val[0])[0]
        elif num in (1, 2):
            raise _Malformed
    return q, g


def from_message(msg: pb.Trajectory) -> WireTrajectory:
    """The same view of a parsed protobuf message (slow path, and for in-process callers)."""
    arrays = {}
    for name in _ARRAY_FIELDS.values():
        if msg.HasField(name):
            a = getattr(msg, name)
            arrays[name] = WireArray(a.dtype, tuple(a.shape), memoryview(a.data))
    return WireTrajectory(session_id=msg.session_id, lease_id=msg.lease_id, task_id=msg.task_id,
                          sample_index=msg.sample_index, arrays=arrays,
                          reward=msg.reward if msg.HasField("reward") else None,
                          finish_reason=msg.finish_reason, queue_ms=msg.timings.queue_ms,
                          generate_ms=msg.timings.generate_ms,
                          reward_parts=[(p.name, p.value) for p in msg.reward_parts])


def decode_trajectory(data: bytes) -> WireTrajectory:
    """Fast path, else the protobuf runtime; raises ``google.protobuf.message.DecodeError``."""
    t = parse_trajectory(data)
    return t if t is not None else from_message(pb.Trajectory.FromString(data))
