"""Per-token diagnostics carried as (sum, count) pairs.

Sums and counts add correctly over micro-batches, devices (psum) and groups, where means do not;
turn them into means only at logging time with ``reduce_metrics``. Keys: ``name`` holds the
overall pair (scalars), ``group/name`` the per-sampler-group pair ([num_groups] each).

The importance-weight diagnostics: ``is_weight`` and ``is_weight_sq`` (means of w and w^2 over
scored tokens) add like the others; ``reduce_metrics`` derives from them the effective sample
size ``ess`` = (sum w)^2 / sum w^2 (tokens; under a sequence mode every token carries its sample's
weight). ``masked_tokens``: share of scored tokens with weight 0; ``masked_seqs``: share of
samples (with at least one scored token) whose every scored token has weight 0.
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


def sequence_metrics(
    weight: Array, valid: Array, seq_ids: Array, group_ids: Array | None, num_groups: int
) -> Metrics:
    """``masked_seqs`` (and ``group/masked_seqs``): (masked samples, samples) over the samples with
    at least one ``valid`` token ([N] inputs; ``seq_ids`` outside [0, N) are ignored). A sample's
    group is that of its valid tokens (one sample comes from one sampler group)."""
    n = weight.shape[0]
    v = valid.astype(jnp.float32)
    scored = jax.ops.segment_sum(v, seq_ids, num_segments=n)
    live = jax.ops.segment_sum(jnp.where(valid & (weight != 0), 1.0, 0.0), seq_ids, num_segments=n)
    has = (scored > 0).astype(jnp.float32)
    masked = has * (live == 0)
    out: Metrics = {"masked_seqs": Metric(masked.sum(), has.sum())}
    if group_ids is not None:
        group = jax.ops.segment_max(jnp.where(valid, group_ids, -1), seq_ids, num_segments=n)
        onehot = (group[:, None] == jnp.arange(num_groups)[None, :]).astype(jnp.float32)
        out["group/masked_seqs"] = Metric(onehot.T @ masked, onehot.T @ has)
    return out


def sum_metrics(*parts: Metrics) -> Metrics:
    """Combine metrics of several micro-batches (same keys) by adding sums and counts."""
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *parts)


def reduce_metrics(metrics: Metrics) -> dict[str, Array]:
    """Means sum / count (NaN where count == 0: no token to average); totals for ``TOTALS``;
    ``ess`` (and ``group/ess``) from the ``is_weight`` / ``is_weight_sq`` sums."""
    out: dict[str, Array] = {}
    for key, m in metrics.items():
        if key.rsplit("/", 1)[-1] in TOTALS:
            out[key] = m.sum
        else:
            out[key] = jnp.where(m.count > 0, m.sum / jnp.where(m.count > 0, m.count, 1.0), jnp.nan)
    for prefix in ("", "group/"):
        w, w2 = metrics.get(f"{prefix}is_weight"), metrics.get(f"{prefix}is_weight_sq")
        if w is not None and w2 is not None:
            # (sum w)^2 / sum w^2; NaN without a token or when every weight is 0.
            ok = w2.sum > 0
            out[f"{prefix}ess"] = jnp.where(ok, w.sum**2 / jnp.where(ok, w2.sum, 1.0), jnp.nan)
    return out
