"""The trainer-side rollout service: gRPC server, validation, buffer, leases, router, auth.

Importing this package pulls in gRPC and numpy, not JAX: ``mixrl-train serve`` starts fast.
"""

from trainer_jax.service.buffer import TrajectoryBuffer, TrajectoryGroup
from trainer_jax.service.router import POLICIES, GroupStats, Router, register_policy
from trainer_jax.service.server import RolloutService
from trainer_jax.service.tasks import EnvTaskSource, TaskSource, TaskSpec, build_task_source
from trainer_jax.service.validation import TrajectoryRecord, ValidationError, validate_trajectory

__all__ = [
    "POLICIES", "EnvTaskSource", "GroupStats", "RolloutService", "Router", "TaskSource", "TaskSpec",
    "TrajectoryBuffer", "TrajectoryGroup", "TrajectoryRecord", "ValidationError", "build_task_source",
    "register_policy", "validate_trajectory",
]
