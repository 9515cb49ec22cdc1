"""The scheduler's records: sessions, leases, tasks in flight, and the two ways a call is refused."""

from __future__ import annotations

import collections
import dataclasses

import grpc

from trainer_jax.service.tasks import TaskSpec
from trainer_jax.service.validation import TrajectoryRecord


class Rejected(Exception):
    """A call is refused: ``code`` is the gRPC status, ``field`` the offending field."""

    def __init__(self, code: grpc.StatusCode, field: str, reason: str):
        super().__init__(f"{field}: {reason}" if field else reason)
        self.code = code
        self.field = field
        self.reason = reason


class Duplicate(Exception):
    """The submission repeats a sample this lease already delivered (an idempotent retry)."""


@dataclasses.dataclass
class Session:
    id: str
    name: str
    group: str
    recipe: dict
    accelerator: str
    capacity: int
    weight_formats: tuple[str, ...]
    peer: str
    last_seen: float
    leases: set[str] = dataclasses.field(default_factory=set)
    outstanding: int = 0
    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0
    rejections: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    weights_version: int = -1
    weight_failures: int = 0
    active_samples: int = 0
    revoked: bool = False
    expired_unreported: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Lease:
    id: str
    session_id: str
    group: str
    task_id: int
    indices: tuple[int, ...]
    remaining: set[int]
    deadline: float
    deadline_unix: float
    granted: float
    evaluation: bool = False


@dataclasses.dataclass
class TaskState:
    spec: TaskSpec
    accepted: dict[int, TrajectoryRecord] = dataclasses.field(default_factory=dict)
