"""Scale-out sections: the device mesh (``mesh:``) and multi-process JAX (``distributed:``).

See ``trainer_jax.parallel`` and ``docs/scale_out.md``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainer_jax.config.base import Strict as _Strict

_MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")


class MeshConfig(_Strict):
    """Sizes of the named mesh axes; their product is the number of devices.

    ``data``/``fsdp``/``expert``/``context``/``tensor`` are the sizes within one slice (TPU) or host (GPU),
    where devices share the fast interconnect; ``-1`` on one axis means "every device the others
    leave" (the default: pure data parallelism). ``dcn_data``/``dcn_fsdp`` multiply the data and
    fsdp axes across slices or hosts (the slow network). ``rules`` overrides the logical-axis
    table of ``trainer_jax.parallel.rules``, e.g. ``{embed: [fsdp, data]}``. ``context`` splits
    every packed row's sequence (context parallelism, ``trainer_jax.parallel.sequence``); it is
    never ``-1`` and has no cross-slice multiplier (its K/V traffic runs every layer).
    ``context_attention`` picks how attention sees the rest of a row under ``context > 1``:
    ``ring`` (the default: K/V blocks passed round the axis, ``trainer_jax.parallel.ring``; a
    device holds ``2 / context`` of a row's K/V and their gradient) or ``all_gather`` (each
    layer's K/V gathered whole: one collective instead of ``context - 1`` hops, more memory;
    ``docs/scale_out.md`` has the measured figures).
    """

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    context: int = Field(1, ge=1)
    tensor: int = 1
    context_attention: Literal["ring", "all_gather"] = "ring"
    dcn_data: int = Field(1, gt=0)
    dcn_fsdp: int = Field(1, gt=0)
    rules: dict[str, list[str]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _sizes(self) -> MeshConfig:
        sizes = {a: getattr(self, a) for a in _MESH_AXES}
        bad = [a for a, n in sizes.items() if n == 0 or n < -1]
        if bad:
            raise ValueError(f"mesh axis sizes must be >= 1 or -1 (the rest), got "
                             f"{ {a: sizes[a] for a in bad} }")
        if sum(n == -1 for n in sizes.values()) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
        for logical, axes in self.rules.items():
            unknown = set(axes) - set(_MESH_AXES)
            if unknown:
                raise ValueError(f"rules.{logical}: unknown mesh axes {sorted(unknown)}; "
                                 f"expected a subset of {list(_MESH_AXES)}")
        return self


class DistributedConfig(_Strict):
    """Multi-process JAX (``jax.distributed.initialize``): one process per TPU VM / GPU host.

    ``mode``: ``off`` never initialises (one process); ``on`` always does (unset fields are
    auto-detected by JAX: TPU metadata, SLURM, Open MPI); ``auto`` initialises only when a
    coordinator is configured or a multi-process launcher is detected. The environment variables
    ``MIXRL_COORDINATOR_ADDRESS``, ``MIXRL_NUM_PROCESSES``, ``MIXRL_PROCESS_ID`` and
    ``MIXRL_LOCAL_DEVICE_IDS`` override the fields, so one config file serves every process.
    """

    mode: Literal["auto", "on", "off"] = "auto"
    coordinator_address: str | None = None
    num_processes: int | None = Field(None, gt=0)
    process_id: int | None = Field(None, ge=0)
    local_device_ids: list[int] | None = None
    initialization_timeout_s: int = Field(300, gt=0)
    #: a process silent this long is named and the others exit non-zero (``parallel.lockstep``);
    #: JAX's own heartbeat gets max(100, twice this + 10) s, so the named line comes first.
    heartbeat_timeout_s: int = Field(30, ge=2)

    @model_validator(mode="after")
    def _consistent(self) -> DistributedConfig:
        if self.coordinator_address is not None:
            host, sep, port = self.coordinator_address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"coordinator_address must be HOST:PORT, got "
                                 f"{self.coordinator_address!r}")
        if (self.process_id is not None and self.num_processes is not None
                and self.process_id >= self.num_processes):
            raise ValueError(f"process_id {self.process_id} must be below num_processes "
                             f"{self.num_processes}")
        return self
