"""Partitioning rules: which mesh axes split each dimension of every parameter and activation.

Two tables, applied from the outside so the model file stays free of sharding annotations:

- ``PARAM_RULES``: a regular expression on a parameter's path (``layers/3/self_attn/q_proj/
  kernel``) -> one *logical* axis name per dimension. The same expressions match the optimizer
  state (``opt_state/.../mu/layers/3/...``), so Adam's moments are sharded like their params.
- ``LOGICAL_AXES``: logical axis -> mesh axes. This is the table a run changes
  (``mesh.rules`` in the config), e.g. to add ``data`` to ``embed`` (ZeRO-3 over every axis).

Defaults (``D`` hidden, ``V`` vocab, ``F`` MLP width, ``E`` experts; kernels are ``[in, out]``):

==========================  ======================  =======================================
parameter                   logical axes            mesh axes (default)
==========================  ======================  =======================================
embed_tokens  [V, D]        vocab, embed            tensor, fsdp
lm_head       [D, V]        embed, vocab            fsdp, tensor (vocabulary-parallel head)
q_proj        [D, H*hd]     embed, heads            fsdp, tensor (Megatron column split)
k_proj/v_proj [D, K*hd]     embed, kv_heads         fsdp, tensor
o_proj        [H*hd, D]     heads, embed            tensor, fsdp (row split)
mlp gate/up   [D, F]        embed, mlp              fsdp, tensor
mlp down      [F, D]        mlp, embed              tensor, fsdp
MoE router    [D, E]        embed, -                fsdp, replicated
MoE gate/up   [E, D, F]     experts, embed, moe_mlp expert, fsdp, tensor
MoE down      [E, F, D]     experts, moe_mlp, embed expert, tensor, fsdp
norms         [D] / [hd]    -                       replicated
==========================  ======================  =======================================

Activations: ``batch`` -> (data, fsdp, expert), ``seq`` -> context (context parallelism: each
row's sequence split, ``sequence.py``), ``tokens`` (the step's N policy tokens) -> (data, fsdp,
expert, context), ``act_embed`` replicated, heads and
MLP columns -> tensor (so attention and MLP run Megatron-style between the column and row
splits). A dimension that a mesh axis does not divide is not split over that axis (with a
``units`` granularity: attention projections split only at head boundaries, so a model with
fewer KV heads than the tensor axis keeps K/V whole, as MaxText does).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

LogicalAxes = tuple[str | None, ...]


def spec_axes(spec: P, dim: int) -> tuple[str, ...]:
    """The mesh axes that split dimension ``dim`` of ``spec`` (major to minor; none past its end)."""
    entry = spec[dim] if dim < len(spec) else None
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)

LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "seq": ("context",),
    "tokens": ("data", "fsdp", "expert", "context"),
    "act_embed": (),
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "experts": ("expert",),
    "moe_mlp": ("tensor",),
}

PARAM_RULES: tuple[tuple[str, LogicalAxes], ...] = (
    (r"embed_tokens/embedding", ("vocab", "embed")),
    (r"lm_head/kernel", ("embed", "vocab")),
    (r"self_attn/q_proj/kernel", ("embed", "heads")),
    (r"self_attn/[kv]_proj/kernel", ("embed", "kv_heads")),
    (r"self_attn/o_proj/kernel", ("heads", "embed")),
    (r"mlp/(gate|up)_proj/kernel", ("embed", "mlp")),
    (r"mlp/down_proj/kernel", ("mlp", "embed")),
    (r"mlp/gate/kernel", ("embed", None)),
    (r"mlp/(gate|up)_proj", ("experts", "embed", "moe_mlp")),
    (r"mlp/down_proj", ("experts", "moe_mlp", "embed")),
    (r"\w*norm/weight", (None,)),
)


def path_str(key_path: Sequence[Any]) -> str:
    """``layers/0/self_attn/q_proj/kernel`` from a pytree key path (nnx's ``.value`` dropped)."""
    parts = []
    for k in key_path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        else:
            parts.append(str(getattr(k, "key", k)))
    if parts and parts[-1] == "value":
        parts.pop()
    return "/".join(parts)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical-axis table, parameter rules and split granularities (see the module docstring)."""

    logical: Mapping[str, tuple[str, ...]] = dataclasses.field(
        default_factory=lambda: dict(LOGICAL_AXES))
    params: tuple[tuple[str, LogicalAxes], ...] = PARAM_RULES
    units: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        compiled = tuple((re.compile(rf"(^|/){pat}$"), axes) for pat, axes in self.params)
        object.__setattr__(self, "_compiled", compiled)

    @classmethod
    def for_model(cls, model_config: Any = None,
                  overrides: Mapping[str, Sequence[str]] | None = None) -> ShardingRules:
        """Default rules, with head granularity from a ``Qwen3Config`` and ``mesh.rules`` overrides."""
        logical = dict(LOGICAL_AXES)
        for name, axes in (overrides or {}).items():
            logical[name] = tuple(axes)
        units = {}
        if model_config is not None:
            units = {"heads": model_config.head_dim, "kv_heads": model_config.head_dim}
        return cls(logical=logical, units=units)

    # -- logical axes -> PartitionSpec -------------------------------------------------------------

    def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, *,
             units: Mapping[str, int] | None = None) -> P:
        """The PartitionSpec for an array of ``shape`` whose dimensions are ``logical_axes``.

        A mesh axis is used at most once per array and only where it divides the dimension (in
        ``units`` granules); size-1 axes are left out so specs stay readable.
        """
        if len(logical_axes) != len(shape):
            raise ValueError(f"logical axes {tuple(logical_axes)} do not fit shape {tuple(shape)}")
        used: set[str] = set()
        out: list[str | tuple[str, ...] | None] = []
        for name, dim in zip(logical_axes, shape, strict=True):
            if name is None:
                out.append(None)
                continue
            if name not in self.logical:
                raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(self.logical)}")
            granules = dim // (units or {}).get(name, 1) if dim % (units or {}).get(name, 1) == 0 else 0
            axes: list[str] = []
            for axis in self.logical[name]:
                size = mesh.shape[axis]
                if axis in used or size == 1:
                    continue
                if granules and granules % (math.prod(mesh.shape[a] for a in axes) * size) == 0:
                    axes.append(axis)
            used.update(axes)
            out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
        while out and out[-1] is None:
            out.pop()
        return P(*out)

    def sharding(self, logical_axes: Sequence[str | None], shape: Sequence[int],
                 mesh: Mesh) -> NamedSharding:
        return NamedSharding(mesh, self.spec(logical_axes, shape, mesh))

    def mesh_axes(self, logical_axis: str, dim: int, mesh: Mesh) -> tuple[str, ...]:
        """The mesh axes that split a dimension of size ``dim`` with logical name ``logical_axis``."""
        entry = self.spec((logical_axis,), (dim,), mesh)
        if not entry:
            return ()
        return entry[0] if isinstance(entry[0], tuple) else (entry[0],)

    # -- parameters and optimizer state ----------------------------------------------------------------

    def param_axes(self, path: str) -> LogicalAxes | None:
        """Logical axes of the parameter (or optimizer slot) at ``path``; None if no rule matches."""
        for pattern, axes in self._compiled:  # type: ignore[attr-defined]
            if pattern.search(path):
                return axes
        return None

    def param_spec(self, path: str, shape: Sequence[int], mesh: Mesh, *, strict: bool = True) -> P:
        """PartitionSpec of a parameter; scalars are replicated.

        ``strict``: a non-scalar without a rule (or with a rule of another rank) is an error;
        otherwise it is replicated (optimizer slots of other shapes, counters).
        """
        if len(shape) == 0:
            return P()
        axes = self.param_axes(path)
        if axes is None or len(axes) != len(shape):
            if strict:
                why = "no rule matches" if axes is None else f"rule {axes} has another rank"
                raise ValueError(f"parameter {path} {tuple(shape)}: {why}; add one to PARAM_RULES")
            return P()
        return self.spec(axes, shape, mesh, units=self.units)

    def state_specs(self, state: Any, mesh: Mesh, *, strict: bool = False) -> Any:
        """A pytree like ``state`` (nnx.State, arrays or ShapeDtypeStructs) of PartitionSpecs."""
        return jax.tree_util.tree_map_with_path(
            lambda kp, x: self.param_spec(path_str(kp), x.shape, mesh, strict=strict), state)

    def state_shardings(self, state: Any, mesh: Mesh, *, strict: bool = False) -> Any:
        """Like ``state_specs``, as ``NamedSharding``s (jit in/out shardings, device_put)."""
        return jax.tree.map(lambda s: NamedSharding(mesh, s), self.state_specs(state, mesh, strict=strict),
                            is_leaf=lambda x: isinstance(x, P))
