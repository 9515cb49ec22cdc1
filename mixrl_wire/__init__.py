"""The mixrl wire: Python modules generated from ``proto/`` plus array encoding helpers.

A neutral top-level package (not inside ``trainer_jax`` or ``sampler_torch``) because both sides
import it and neither should pull in the other's heavy dependencies (JAX, torch): an external
sampler needs only this package and ``sampler_torch.client``, which import no torch.
``mixrl_wire.encoder`` writes trajectories, ``mixrl_wire.fastpath`` reads them.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any

SERVICE_NAME = "mixrl.v1.Rollout"

# The generated modules (and what is read off them) load on first use, so that the parts of this
# package that need no protobuf -- the recipe table (``mixrl_wire.recipes``) the samplers' quantized
# linears and the converter read -- import on a machine whose protobuf / grpcio are older than the
# generated code asks for (the GPU check's torch part, say).
_GENERATED = {"pb": "mixrl_wire.v1.rollout_pb2", "pb_grpc": "mixrl_wire.v1.rollout_pb2_grpc"}


def _trajectory_array_fields() -> MappingProxyType:
    """``Trajectory``'s ``Array`` fields, name -> field number, in field-number (= wire) order. Read
    off the generated descriptor so that the encoder, the fast-path decoder and the client's size
    bound cannot drift from proto/ when a field is added or renumbered."""
    pb = __getattr__("pb")
    return MappingProxyType({
        f.name: f.number for f in sorted(pb.Trajectory.DESCRIPTOR.fields, key=lambda f: f.number)
        if f.message_type is not None and f.message_type.full_name == pb.Array.DESCRIPTOR.full_name})


def __getattr__(name: str) -> Any:
    if name in _GENERATED:
        value = importlib.import_module(_GENERATED[name])
    elif name == "TRAJECTORY_ARRAY_FIELDS":
        value = _trajectory_array_fields()
    else:
        raise AttributeError(f"module 'mixrl_wire' has no attribute {name!r}")
    globals()[name] = value  # computed once
    return value


# HTTP/2 settings for channels that carry trajectories (hundreds of kB each) on both ends: the
# largest frames HTTP/2 allows and a large write buffer cut per-frame work; BDP probing is off
# because the windows it grows toward are reached at once with these. Measured with
# benchmarks/bench_transport.py: ~+25% MB/s for opaque payloads on loopback.
BULK_CHANNEL_OPTIONS = (
    ("grpc.http2.max_frame_size", 16_777_215),
    ("grpc.http2.write_buffer_size", 8 * 1024**2),
    ("grpc.http2.bdp_probe", 0),
)

__all__ = ["BULK_CHANNEL_OPTIONS", "SERVICE_NAME", "TRAJECTORY_ARRAY_FIELDS", "pb", "pb_grpc"]
