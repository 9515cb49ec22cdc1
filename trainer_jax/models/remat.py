"""Rematerialisation per decoder layer: what a layer keeps for the backward pass.

``remat``: ``"none"`` keeps every intermediate; ``"full"`` keeps only the layer's inputs and
recomputes the layer in the backward pass (activation memory ~ one residual stream per layer);
any other name is a ``jax.checkpoint_policies`` attribute, e.g. ``dots_with_no_batch_dims_saveable``
(keep the projection matmul outputs, recompute the cheap elementwise work and attention).

With remat on, consecutive layers of one structure run as a ``lax.scan`` over their stacked
states with a checkpointed body (``run_layers``). Checkpointing layers unrolled in Python does not
bound memory: XLA is free to schedule every layer's recomputation early, and XLA:CPU's scheduler
does (Qwen3-0.6B shape, 4 x 16,384 tokens: 219.2 GiB temporary memory without remat, 219.3 GiB with
per-layer ``nnx.remat``). A scan's backward is a loop, so it recomputes one layer at a time. The
parameters keep their per-layer layout (HF names, sharding rules, checkpoints): the stack is built
inside the traced step and its gradient flows back to each layer's parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from trainer_jax.parallel import hooks

NONE, FULL = "none", "full"
# jax.checkpoint_policies entries that build a policy from arguments rather than being one.
_FACTORIES = ("offload_dot_with_no_batch_dims", "save_and_offload_only_these_names",
              "save_any_names_but_these", "save_anything_except_these_names",
              "save_from_both_policies", "save_only_these_names")

Array = jax.Array
Constrain = Callable[[Array], Array]


def _policies() -> list[str]:
    return sorted(n for n in dir(jax.checkpoint_policies)
                  if not n.startswith("_") and n not in _FACTORIES)


def remat_options() -> list[str]:
    """Every accepted ``remat`` value."""
    return [NONE, FULL, *_policies()]


def remat_policy(remat: str) -> Callable | None:
    """The ``jax.checkpoint`` policy of a remat mode other than ``none`` (``None``: save nothing)."""
    if remat == FULL:
        return None
    if remat == NONE or remat not in _policies():
        raise ValueError(f"remat {remat!r}: expected 'none', 'full' or a jax.checkpoint_policies "
                         f"policy, one of {remat_options()}")
    return getattr(jax.checkpoint_policies, remat)


def check_remat(remat: str) -> None:
    """Raise ``ValueError`` for an unknown ``remat`` name."""
    if remat != NONE:
        remat_policy(remat)


def _runs(layers: Sequence[nnx.Module]) -> list[tuple[nnx.GraphDef, list[nnx.State]]]:
    """Consecutive layers of one structure (dense / MoE), each run as (graphdef, states)."""
    runs: list[tuple[nnx.GraphDef, list[nnx.State]]] = []
    for layer in layers:
        graphdef, state = nnx.split(layer)
        if runs and runs[-1][0] == graphdef:
            runs[-1][1].append(state)
        else:
            runs.append((graphdef, [state]))
    return runs


def run_layers(layers: Sequence[nnx.Module], x: Array, positions: Array, segment_ids: Array,
               remat: str, constrain: Constrain) -> Array:
    """Apply the decoder ``layers`` in order under ``remat``; ``constrain`` pins each output.

    ``none``: the layers unrolled, as before. Otherwise each run of same-structure layers is a
    ``lax.scan`` whose body, checkpointed with the mode's policy, merges one layer from the
    stacked states; the forward saves the residual stream entering each layer, the backward
    recomputes one layer at a time.
    """
    if remat == NONE:
        for layer in layers:
            x = constrain(layer(x, positions, segment_ids))
        return x
    policy = remat_policy(remat)
    # On a device mesh, each stacked leaf is split like one layer's parameter (layer axis whole),
    # so FSDP gathers one layer per iteration rather than the whole stack up front.
    place = hooks.override("layer_stack") or (lambda stacked: stacked)
    for graphdef, states in _runs(layers):

        def body(carry: Array, state: nnx.State, graphdef: nnx.GraphDef = graphdef) -> tuple[Array, None]:
            return constrain(nnx.merge(graphdef, state)(carry, positions, segment_ids)), None

        # prevent_cse=False: inside a scan the recomputation cannot be CSE'd with the forward.
        step = jax.checkpoint(body, policy=policy, prevent_cse=False)
        stacked = place(jax.tree.map(lambda *leaves: jnp.stack(leaves), *states))
        x, _ = jax.lax.scan(step, x, stacked)
    return x
