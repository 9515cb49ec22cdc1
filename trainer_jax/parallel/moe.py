"""Expert-parallel MoE with ``shard_map``: experts split over the ``expert`` axis.

Layout inside the map (per device): its own tokens (the batch is split over data, fsdp and
expert), the router whole, ``E / expert`` experts with their ``F / tensor`` MLP columns, the
hidden dimension whole (FSDP shards of the expert weights are gathered at the map's boundary,
and their gradients reduce-scattered back, by the partitioner).

Dispatch is all-gather / reduce-scatter over the expert axis (Megatron's "allgather" token
dispatcher): the devices of one expert group gather their tokens, each routes all of them, runs
its local experts on the copies routed to them (copies for other devices' experts belong to no
group of the local grouping and come out as zeros), and the partial outputs are summed back
with a reduce-scatter, so every device ends with its own tokens' full output. No capacity
factor, no dropped tokens: the result is the single-device ``MoE.__call__`` up to summation
order. Column-split (``tensor``) down-projection partials are summed with a psum. The routing
and expert math are the model's own (``MoE.route``, ``MoE.expert_ffn``) on the
local shards.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from trainer_jax.models.grouped_matmul import group_rows
from trainer_jax.parallel import hooks
from trainer_jax.parallel.context import ParallelContext, linear_axis_index
from trainer_jax.parallel.rules import path_str, spec_axes

Array = jax.Array


def moe_forward(ctx: ParallelContext, module: Any, x: Array) -> Array:
    """``module(x)`` for a ``qwen3.MoE`` with its experts split over the mesh (see module doc)."""
    mesh, rules = ctx.mesh, ctx.rules
    b, t, d = x.shape
    num_experts = module.num_experts
    x_spec = rules.spec(("batch", "seq", None), x.shape, mesh)
    token_axes = set(spec_axes(x_spec, 0) + spec_axes(x_spec, 1))

    graphdef, state = nnx.split(module)
    up_shape = module.gate_proj.get_value().shape  # [E, D, F]
    up_spec = rules.spec(("experts", None, "moe_mlp"), up_shape, mesh, units=rules.units)
    exp_axes, f_axes = spec_axes(up_spec, 0), spec_axes(up_spec, 2)
    down_spec = P(exp_axes or None, f_axes or None)  # [E, F, D]

    def spec_of(path: str) -> P:
        name = path.rsplit("/", 1)[-1]
        return {"gate_proj": up_spec, "up_proj": up_spec, "down_proj": down_spec}.get(name, P())

    state_specs = jax.tree_util.tree_map_with_path(lambda kp, _: spec_of(path_str(kp)), state)
    gather_axes = tuple(a for a in exp_axes if a in token_axes)  # tokens split here: gather them
    sum_axes = tuple(a for a in exp_axes if a not in token_axes) + f_axes
    e_local = num_experts // math.prod(mesh.shape[a] for a in exp_axes)

    def local(state_l: Any, x_l: Array) -> Array:
        with hooks.use(None):
            m = nnx.merge(graphdef, state_l)
            bl, tl, _ = x_l.shape
            tokens = x_l.reshape(bl * tl, d)
            if gather_axes:
                tokens = jax.lax.all_gather(tokens, gather_axes, axis=0, tiled=True)
            weights, experts = m.route(tokens)  # [M, k]
            first = linear_axis_index(exp_axes, mesh) * e_local if exp_axes else 0
            local_ids = experts - first  # outside [0, e_local): another device's expert
            rows = group_rows(local_ids.reshape(-1), e_local, impl=m.moe_impl)
            y = rows.unpack_combine(m.expert_ffn(tokens, rows), weights).astype(x_l.dtype)
            if gather_axes:
                y = jax.lax.psum_scatter(y, gather_axes, scatter_dimension=0, tiled=True)
            if sum_axes:
                y = jax.lax.psum(y, sum_axes)
            return y.reshape(bl, tl, d)

    return jax.shard_map(local, mesh=mesh, in_specs=(state_specs, x_spec), out_specs=x_spec,
                         check_vma=False)(state, x)
