"""Which sharded operation the model's hooks get under an active ``ParallelContext``.

``use(ctx)`` activates ``ShardedOps(ctx)`` as the hooks provider (``trainer_jax.parallel.hooks``)
for the duration: the model's single-device code asks ``hooks.override(name)`` and gets the
shard_map implementation bound to the context, or None where the partitioner's own program is
right. This module sits above the implementations (they import ``context``, never this).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import jax

from trainer_jax.parallel import hooks, sequence
from trainer_jax.parallel.attention import attention_forward
from trainer_jax.parallel.context import ParallelContext
from trainer_jax.parallel.embed import embed_lookup
from trainer_jax.parallel.moe import moe_forward
from trainer_jax.parallel.vocab import vocab_parallel_lse_and_logits_at

#: operations context parallelism replaces (``parallel/sequence.py``: rows' sequences split)
_CONTEXT_OPS = {"attention": sequence.context_attention, "sequence_layout": sequence.layout_inputs,
                "token_gather": sequence.token_gather}


class ShardedOps:
    """The hooks provider of one ``ParallelContext``."""

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        return self.ctx.constrain(x, logical_axes)

    def override(self, name: str) -> Callable[..., Any] | None:
        ctx = self.ctx
        if name == "moe" and ctx.expert_parallel:
            return partial(moe_forward, ctx)
        if name == "lse_and_logits_at" and ctx.vocab_parallel:
            return partial(vocab_parallel_lse_and_logits_at, ctx)
        if name in _CONTEXT_OPS and ctx.mesh.shape.get("context", 1) > 1:
            return partial(_CONTEXT_OPS[name], ctx)
        if name == "attention":
            return partial(attention_forward, ctx)
        if name == "embed":
            return partial(embed_lookup, ctx)
        if name == "layer_stack":
            return ctx.constrain_layer_stack
        return None


@contextlib.contextmanager
def use(ctx: ParallelContext) -> Iterator[None]:
    """Run the model and loss sharded under ``ctx`` in this thread for the duration."""
    with hooks.use(ShardedOps(ctx)):
        yield
