"""``ParallelContext``: the mesh and rules a sharded trace runs under.

The sharded operations (``moe``, ``vocab``, ``sequence``, ``attention``, ``embed``) take a context;
``trainer_jax.parallel.dispatch`` picks them for the model's hooks. Keeping the choice there, not
here, is what lets those modules import this one without a circle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer_jax.parallel.rules import ShardingRules, path_str


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """Mesh + rules; while active (``with dispatch.use(ctx):``) the model and loss run sharded.

    ``expert_parallel`` / ``vocab_parallel`` switch the two ``shard_map`` implementations off (the
    partitioner then derives a correct but all-gathering program), for comparisons.
    """

    mesh: Mesh
    rules: ShardingRules
    expert_parallel: bool = True
    vocab_parallel: bool = True
    #: attention under context parallelism: ``ring`` (K/V blocks passed round the axis,
    #: ``parallel/ring.py``) or ``all_gather`` (each layer's K/V gathered; ``parallel/sequence.py``)
    context_attention: str = "ring"

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.rules.sharding(logical_axes, x.shape, self.mesh))

    def constrain_layer_stack(self, stacked: Any) -> Any:
        """Decoder-layer states stacked on a leading axis (the remat scan): each leaf split like
        that parameter of one layer, the layer axis whole, so a scan step gathers one layer."""
        def place(key_path, x):
            spec = self.rules.param_spec("layers/0/" + path_str(key_path), x.shape[1:], self.mesh,
                                         strict=False)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(None, *spec)))

        return jax.tree_util.tree_map_with_path(place, stacked)


def linear_axis_index(axes: Sequence[str], mesh: Mesh) -> jax.Array:
    """Inside ``shard_map``: this device's shard index along a dimension split over ``axes``
    (major to minor, the PartitionSpec order)."""
    index = jax.numpy.int32(0)
    for axis in axes:
        index = index * mesh.shape[axis] + jax.lax.axis_index(axis)
    return index
