"""The mixrl wire: Python modules generated from ``proto/`` plus array encoding helpers.

A neutral top-level package (not inside ``trainer_jax`` or ``sampler_torch``) because both sides
import it and neither should pull in the other's heavy dependencies (JAX, torch): an external
sampler needs only this package and ``sampler_torch.client``, which import no torch.
"""

from mixrl_wire.v1 import rollout_pb2 as pb
from mixrl_wire.v1 import rollout_pb2_grpc as pb_grpc

SERVICE_NAME = "mixrl.v1.Rollout"

__all__ = ["SERVICE_NAME", "pb", "pb_grpc"]
