"""Per-token diagnostics carried as (sum, count) pairs.

Sums and counts add correctly over micro-batches, devices (psum) and groups, where means do not;
turn them into means only at logging time with ``reduce_metrics``. Keys: ``name`` holds the
overall pair (scalars), ``group/name`` the per-sampler-group pair ([num_groups] each).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

# Keys whose reduced value is the total (sum), not the mean.
TOTALS = ("tokens",)


class Metric(NamedTuple):
    """A running (sum, count) pair; a pytree, so jax.tree.map / psum reduce it directly."""

    sum: Array
    count: Array


Metrics = dict[str, Metric]


def token_metrics(
    values: Mapping[str, Array],
    weight: Array,
    group_ids: Array | None,
    num_groups: int,
) -> Metrics:
    """Reduce per-token ``values`` ([N] each) with 0/1 ``weight`` [N], overall and per group.

    Tokens whose group id is outside [0, num_groups) count only in the overall metrics.
    """
    names = list(values)
    stacked = jnp.stack([jnp.asarray(values[k], jnp.float32) for k in names], axis=1)  # [N, m]
    weight = weight.astype(jnp.float32)
    # where, not multiply: a masked token's value may be inf/NaN garbage.
    contrib = jnp.where(weight[:, None] > 0, stacked * weight[:, None], 0.0)
    sums = contrib.sum(axis=0)
    count = weight.sum()
    out: Metrics = {k: Metric(sums[i], count) for i, k in enumerate(names)}
    out["tokens"] = Metric(count, count)
    if group_ids is not None:
        onehot = (group_ids[:, None] == jnp.arange(num_groups)[None, :]).astype(jnp.float32)
        g_sums = onehot.T @ contrib  # [G, m]
        g_count = onehot.T @ weight  # [G]
        for i, k in enumerate(names):
            out[f"group/{k}"] = Metric(g_sums[:, i], g_count)
        out["group/tokens"] = Metric(g_count, g_count)
    return out


def sum_metrics(*parts: Metrics) -> Metrics:
    """Combine metrics of several micro-batches (same keys) by adding sums and counts."""
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *parts)


def reduce_metrics(metrics: Metrics) -> dict[str, Array]:
    """Means sum / count (NaN where count == 0: no token to average); totals for ``TOTALS``."""
    out: dict[str, Array] = {}
    for key, m in metrics.items():
        if key.rsplit("/", 1)[-1] in TOTALS:
            out[key] = m.sum
        else:
            out[key] = jnp.where(m.count > 0, m.sum / jnp.where(m.count > 0, m.count, 1.0), jnp.nan)
    return out
