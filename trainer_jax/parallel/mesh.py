"""The device mesh: named axes ``data``, ``fsdp``, ``expert``, ``context``, ``tensor`` from a
``MeshConfig``.

Axis order is major to minor: ``tensor`` is innermost because tensor parallelism communicates
inside every layer (all-reduces of activations) and must sit on the nearest devices; ``context``
next (each attention layer passes the row's K/V blocks round it, and their gradients back —
ring attention, ``mesh.context_attention: ring`` — or gathers K/V and reduce-scatters dK/dV
with ``all_gather``: it wants the fast interconnect too, and it never spans slices: no
``dcn_context``); ``expert``
next (one all-gather / reduce-scatter of tokens per MoE layer); ``fsdp`` gathers weights once per
layer and reduce-scatters gradients; ``data`` only all-reduces gradients, once per step, so it
is outermost and the one that may span the slow network (``dcn_data``).

Every mesh has all five axes (size 1 when unused), so partitioning rules never need to know
which axes a run uses. Axes are ``AxisType.Auto``: the SPMD partitioner propagates shardings
from the annotated inputs, parameters and activations.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from trainer_jax.config import ConfigError, MeshConfig

log = logging.getLogger("mixrl.parallel")

AXES: tuple[str, ...] = ("data", "fsdp", "expert", "context", "tensor")
#: Axes that split the batch's rows: every axis but ``context`` (which splits each row's sequence)
#: and ``tensor`` (whose devices share their tokens).
BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")
_DCN = {"data": "dcn_data", "fsdp": "dcn_fsdp"}


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
    """(per-slice sizes, cross-slice sizes) of each axis for ``num_devices`` devices.

    Resolves the one ``-1`` axis; raises ``ConfigError`` (a ``ValueError``) naming the ``mesh.*``
    keys when the sizes do not multiply out: ``mixrl-train`` prints it as one line and exits 2,
    right after the devices are found and before the run directory is touched.
    """
    dcn = {a: getattr(cfg, _DCN[a]) if a in _DCN else 1 for a in AXES}
    n_dcn = math.prod(dcn.values())
    if num_devices % n_dcn:
        raise ConfigError(f"mesh.dcn_data / mesh.dcn_fsdp: {num_devices} devices cannot be split "
                          f"into {n_dcn} slices/hosts (dcn sizes {dcn})")
    per_slice = num_devices // n_dcn
    ici = {a: getattr(cfg, a) for a in AXES}
    fixed = math.prod(n for n in ici.values() if n != -1)
    free = [a for a, n in ici.items() if n == -1]
    if free:
        if per_slice % fixed:
            sizes = " x ".join(f"mesh.{a} {n}" for a, n in ici.items() if n != -1)
            raise ConfigError(f"mesh: {per_slice} devices per slice are not a multiple of {sizes} "
                              f"= {fixed}")
        ici[free[0]] = per_slice // fixed
    if math.prod(ici.values()) != per_slice:
        raise ConfigError(f"mesh: {ici} x dcn {dcn} needs {math.prod(ici.values()) * n_dcn} "
                          f"devices, have {num_devices} (set mesh.data: -1 to use the devices there are)")
    return ici, dcn


def make_mesh(cfg: MeshConfig | None = None, *, devices: Sequence[jax.Device] | None = None,
              **sizes: int) -> Mesh:
    """A ``Mesh`` over ``devices`` (default: all, every process) with axes ``AXES``.

    ``make_mesh(cfg.mesh)`` from a run config, or ``make_mesh(fsdp=2, tensor=4)`` (unnamed axes
    default to 1, ``data`` to -1).
    """
    if cfg is None:
        cfg = MeshConfig(**sizes)
    elif sizes:
        raise TypeError("pass either a MeshConfig or axis sizes, not both")
    devices = list(jax.devices() if devices is None else devices)
    ici, dcn = mesh_shape(cfg, len(devices))
    ici_shape = [ici[a] for a in AXES]
    dcn_shape = [dcn[a] for a in AXES]
    if math.prod(dcn_shape) > 1:
        # One granule per TPU slice (devices know their slice_index) or per GPU host (process).
        grid = mesh_utils.create_hybrid_device_mesh(
            ici_shape, dcn_shape, devices, process_is_granule=devices[0].platform != "tpu",
            allow_split_physical_axes=True)
    else:
        try:
            # Topology-aware on TPU/GPU (rings and tori along the inner axes); a reshape on CPU.
            grid = mesh_utils.create_device_mesh(ici_shape, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError) as e:
            log.warning("no topology-aware layout for mesh %s (%s); using device order", ici, e)
            grid = np.asarray(devices, dtype=object).reshape(ici_shape)
    mesh = Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))
    log.info("device mesh %s over %d devices (%d processes)", dict(mesh.shape), len(devices),
             len({d.process_index for d in devices}))
    return mesh


def describe(mesh: Mesh) -> str:
    """``data=2 fsdp=2 expert=2 context=1 tensor=1`` for logs and benchmark keys."""
    return " ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
