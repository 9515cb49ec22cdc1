"""Aggregations: per-token losses [N] -> scalar loss.

``mask`` is the effective loss mask (float 0/1); masked tokens contribute neither to sums nor to
counts. ``seq_ids`` are batch-local sequence indices in [0, N) (ids outside are ignored).

Note: ``token_mean`` and ``seq_mean_token_mean`` normalise by what is in *this* batch; when a step
is split into micro-batches or shards, ``constant`` (divide by a fixed number, e.g. the expected
token count of the global batch) keeps the sum over micro-batches equal to the full-batch loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import jax
import jax.numpy as jnp

from trainer_jax.config.base import check_registry
from trainer_jax.config.objective_names import AGGREGATIONS as AGGREGATION_NAMES
from trainer_jax.objective.registry import Registry

if TYPE_CHECKING:
    from trainer_jax.objective.config import ObjectiveConfig

Array = jax.Array


class AggregationFn(Protocol):
    def __call__(self, per_token: Array, mask: Array, seq_ids: Array, config: ObjectiveConfig) -> Array: ...


AGGREGATIONS: Registry[AggregationFn] = Registry("aggregation")


@AGGREGATIONS.register("token_mean")
def token_mean(per_token: Array, mask: Array, seq_ids: Array, config: ObjectiveConfig) -> Array:
    """L = sum_t m_t l_t / max(sum_t m_t, 1)."""
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(per_token: Array, mask: Array, seq_ids: Array, config: ObjectiveConfig) -> Array:
    """L = mean over sequences s with >= 1 token of ( sum_{t in s} m_t l_t / sum_{t in s} m_t )."""
    n = per_token.shape[0]
    seq_sum = jax.ops.segment_sum(per_token * mask, seq_ids, num_segments=n)
    seq_cnt = jax.ops.segment_sum(mask, seq_ids, num_segments=n)
    has = seq_cnt > 0
    seq_mean = jnp.where(has, seq_sum / jnp.maximum(seq_cnt, 1.0), 0.0)
    return jnp.sum(seq_mean) / jnp.maximum(jnp.sum(has), 1)


@AGGREGATIONS.register("constant")
def constant(per_token: Array, mask: Array, seq_ids: Array, config: ObjectiveConfig) -> Array:
    """L = sum_t m_t l_t / constant_normalizer."""
    return jnp.sum(per_token * mask) / config.constant_normalizer


check_registry(AGGREGATIONS.kind, AGGREGATIONS.names(), AGGREGATION_NAMES)
