"""Rematerialisation per decoder layer: what a layer keeps for the backward pass.

``remat``: ``"none"`` keeps every intermediate; ``"full"`` keeps only the layer's inputs and
recomputes the layer in the backward pass (activation memory ~ one residual stream per layer);
any other name is a ``jax.checkpoint_policies`` attribute, e.g. ``dots_with_no_batch_dims_saveable``
(keep the projection matmul outputs, recompute the cheap elementwise work and attention).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

NONE, FULL = "none", "full"
# jax.checkpoint_policies entries that build a policy from arguments rather than being one.
_FACTORIES = ("offload_dot_with_no_batch_dims", "save_and_offload_only_these_names",
              "save_any_names_but_these", "save_anything_except_these_names",
              "save_from_both_policies", "save_only_these_names")


def _policies() -> list[str]:
    return sorted(n for n in dir(jax.checkpoint_policies)
                  if not n.startswith("_") and n not in _FACTORIES)


def remat_options() -> list[str]:
    """Every accepted ``remat`` value."""
    return [NONE, FULL, *_policies()]


def _call(layer, x, positions, segment_ids):
    return layer(x, positions, segment_ids)


def remat_layer(remat: str) -> Callable:
    """``f(layer, x, positions, segment_ids)`` applying ``layer`` under the ``remat`` mode."""
    if remat == NONE:
        return _call
    if remat == FULL:
        return nnx.remat(_call)
    if remat not in _policies():
        raise ValueError(f"remat {remat!r}: expected 'none', 'full' or a jax.checkpoint_policies "
                         f"policy, one of {remat_options()}")
    return nnx.remat(_call, policy=getattr(jax.checkpoint_policies, remat))
