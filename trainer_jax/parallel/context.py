"""``ParallelContext``: the mesh and rules a sharded trace runs under (the ``hooks`` provider)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer_jax.parallel import hooks
from trainer_jax.parallel.rules import ShardingRules, path_str


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """Mesh + rules; while active (``with ctx.use():``) the model and loss run sharded.

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

    def override(self, name: str) -> Callable[..., Any] | None:
        if name == "moe" and self.expert_parallel:
            from trainer_jax.parallel.moe import moe_forward

            return partial(moe_forward, self)
        if name == "lse_and_logits_at" and self.vocab_parallel:
            from trainer_jax.parallel.vocab import vocab_parallel_lse_and_logits_at

            return partial(vocab_parallel_lse_and_logits_at, self)
        if name in ("attention", "sequence_layout", "token_gather") and self.mesh.shape.get("context", 1) > 1:
            from trainer_jax.parallel import sequence  # context parallelism: rows' sequences split

            impl = {"attention": sequence.context_attention, "sequence_layout": sequence.layout_inputs,
                    "token_gather": sequence.token_gather}[name]
            return partial(impl, self)
        if name == "attention":
            from trainer_jax.parallel.attention import attention_forward

            return partial(attention_forward, self)
        if name == "embed":
            from trainer_jax.parallel.embed import embed_lookup

            return partial(embed_lookup, self)
        if name == "layer_stack":
            return self.constrain_layer_stack
        return None

    def constrain_layer_stack(self, stacked: Any) -> Any:
        """Decoder-layer states stacked on a leading axis (the remat scan): each leaf split like
        that parameter of one layer, the layer axis whole, so a scan step gathers one layer."""
        def place(key_path, x):
            spec = self.rules.param_spec("layers/0/" + path_str(key_path), x.shape[1:], self.mesh,
                                         strict=False)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(None, *spec)))

        return jax.tree_util.tree_map_with_path(place, stacked)

    def use(self):
        """Context manager activating this context's hooks in the current thread."""
        return hooks.use(self)


def linear_axis_index(axes: Sequence[str], mesh: Mesh) -> jax.Array:
    """Inside ``shard_map``: this device's shard index along a dimension split over ``axes``
    (major to minor, the PartitionSpec order)."""
    index = jax.numpy.int32(0)
    for axis in axes:
        index = index * mesh.shape[axis] + jax.lax.axis_index(axis)
    return index
