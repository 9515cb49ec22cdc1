"""The scheduler's records: sessions, leases, tasks in flight, and the two ways a call is refused."""

from __future__ import annotations

import collections
import dataclasses

import grpc

from mixrl_wire.recipes import WEIGHT_FORMATS
from trainer_jax.service.tasks import TaskSpec
from trainer_jax.service.validation import TrajectoryRecord


class Rejected(Exception):
    """A call is refused: ``code`` is the gRPC status, ``field`` the offending field."""

    def __init__(self, code: grpc.StatusCode, field: str, reason: str):
        super().__init__(f"{field}: {reason}" if field else reason)
        self.code = code
        self.field = field
        self.reason = reason


def describe_device(device: dict, recipe: str | None = None) -> str:
    """One phrase for logs and start-up lines: ``cuda NVIDIA H200 (9.0), fp8 native``; with
    ``recipe`` only that recipe's kernel, else every recipe's; ``unreported`` when empty."""
    if not device:
        return "device unreported"
    name = device.get("name", "")
    text = f"{device.get('type', '?')} {name}".strip()
    if device.get("capability"):
        text += f" ({device['capability']})"
    kernels = device.get("kernels", {})
    if recipe is not None and recipe in kernels:
        return f"{text}, {recipe} matmuls {kernels[recipe]}"
    if kernels:
        text += ", matmuls " + " ".join(f"{r}:{k}" for r, k in kernels.items())
    return text


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string: ``ipv4:10.0.0.7:5123`` -> ``10.0.0.7``, ``ipv6:[::1]:5123``
    -> ``::1``; anything else as it is."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]") or rest
    return peer


def registration_line(s: Session) -> str:
    """The trainer console's line for one registration (spawned, external or fleet alike): who,
    which group and recipe, from which host, on what device, and how every recipe's matmuls run
    there (``native`` or ``emulate``)."""
    recipe = s.recipe.get("name") or "?"
    kernels = s.device.get("kernels") or {}
    every = " ".join(f"{r}:{k}" for r, k in sorted(kernels.items()))
    return (f"sampler {s.name} registered: group {s.group}, recipe {recipe}, host {peer_host(s.peer)}, "
            f"{describe_device(s.device, recipe)}" + (f" (matmuls here: {every})" if every else ""))


def registration_fields(req) -> tuple[dict, dict]:
    """A ``RegisterRequest``'s recipe and device as the session keeps them; ``Rejected`` for a
    request without a group, with a capacity below 1, or naming an unknown weight format."""
    if not req.group:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "group", "missing")
    if req.capacity < 1:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "capacity", "must be >= 1")
    unknown = [f for f in req.weight_formats if f not in WEIGHT_FORMATS]
    if unknown:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "weight_formats",
               f"unknown format(s) {unknown}; known: {', '.join(WEIGHT_FORMATS)}")
    recipe = {f: getattr(req.recipe, f) for f in ("name", "weight_format", "activation_format",
                               "kv_dtype", "backend", "logit_noise")}
    if req.recipe.HasField("round_weights"):
        recipe["round_weights"] = {"bits": req.recipe.round_weights.bits,
                       "block_size": req.recipe.round_weights.block_size}
    device = ({"type": req.device.type, "name": req.device.name,
           "capability": req.device.capability, "kernels": dict(req.device.kernels)}
          if req.HasField("device") else {})
    return recipe, device


class Duplicate(Exception):
    """The submission repeats a sample this lease already delivered (an idempotent retry)."""


@dataclasses.dataclass
class ProbeState:
    """A session's version-probe record: its last report and the newest version it verified."""

    version: int = -1            # version of the last report
    verified_version: int = -1   # newest version whose probe passed (-1: unverified)
    kl: float = 0.0
    max_abs: float = 0.0
    verdict: str = ""
    reason: str = ""
    reload_requests: int = 0     # RELOADs asked of it (no-op reloads, stale weights)
    alarms: int = 0              # reports above the bound
    alarming: bool = False       # its last report raised (or kept) an alarm
    above_streak: int = 0        # reports above the bound in a row


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
    #: what the sampler computes on (``ComputeDevice``: type, name, capability, kernels); empty
    #: for samplers that do not say
    device: dict = dataclasses.field(default_factory=dict)
    revoked_reason: str = ""
    #: samples it gave back (``ReturnLease``) per reason, and the environments (``Task.env``) it
    #: said it cannot run: it is not leased their tasks again
    returned: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    unrunnable_envs: set[str] = dataclasses.field(default_factory=set)
    #: the version probe (``trainer_jax.service.probes``): the last report's version and verdict
    probe: ProbeState = dataclasses.field(default_factory=lambda: ProbeState())


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
