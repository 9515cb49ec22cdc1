"""Objective metrics at their edges (issue 37): a mean over exactly one token, a group with none,
masked garbage, totals, groups out of range. A mutation run of ``trainer_jax/objective/`` found a
metric over one token could turn NaN unnoticed (``count > 1`` for ``count > 0``)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from trainer_jax.objective.metrics import reduce_metrics, sum_metrics, token_metrics


def _reduced(metrics) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in reduce_metrics(metrics).items()}


def test_means_over_one_token_none_and_masked_garbage():
    values = {"kl": jnp.array([0.5, jnp.inf, 2.0, 4.0, jnp.nan]),
              "ratio": jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])}
    weight = jnp.array([1, 0, 1, 1, 0])
    groups = jnp.array([0, 0, 1, 7, 1])  # group 2 has no token; id 7 counts only overall
    r = _reduced(token_metrics(values, weight, groups, num_groups=3))
    assert math.isclose(float(r["kl"]), (0.5 + 2.0 + 4.0) / 3, rel_tol=1e-6) and float(r["tokens"]) == 3.0
    assert math.isclose(float(r["ratio"]), (1.0 + 3.0 + 4.0) / 3, rel_tol=1e-6)
    # one token in group 0 and one in group 1: their means are those tokens' values, not NaN
    assert r["group/kl"][:2].tolist() == [0.5, 2.0] and math.isnan(r["group/kl"][2])
    assert r["group/ratio"][:2].tolist() == [1.0, 3.0]
    assert r["group/tokens"].tolist() == [1.0, 1.0, 0.0]  # totals, not means


def test_micro_batches_add_sums_and_counts():
    a = token_metrics({"x": jnp.array([1.0, 3.0])}, jnp.array([1, 1]), None, 1)
    b = token_metrics({"x": jnp.array([8.0])}, jnp.array([1]), None, 1)
    r = _reduced(sum_metrics(a, b))
    assert math.isclose(float(r["x"]), 4.0) and float(r["tokens"]) == 3.0
    assert "group/x" not in r
    empty = _reduced(token_metrics({"x": jnp.array([5.0])}, jnp.array([0]), None, 1))
    assert math.isnan(float(empty["x"])) and float(empty["tokens"]) == 0.0


def test_masked_logsumexp_is_exact_away_from_zero_and_minus_inf_for_empty_rows():
    from trainer_jax.objective.loss import _masked_logsumexp

    x = jnp.array([[3.0, 5.0, 100.0], [-40.0, -42.0, jnp.nan], [1.0, 2.0, 3.0]])
    mask = jnp.array([[True, True, False], [True, True, False], [False, False, False]])
    got = np.asarray(_masked_logsumexp(x, mask))
    want = [np.logaddexp(3.0, 5.0), np.logaddexp(-40.0, -42.0)]
    np.testing.assert_allclose(got[:2], want, rtol=1e-6)
    assert got[2] == -np.inf  # no entry: -inf, not NaN


@pytest.mark.parametrize("tau", [0.0, -1.0])
def test_a_batch_whose_temperature_was_set_to_zero_after_create_is_refused_by_the_loss(tau):
    """``TokenBatch.create`` refuses tau <= 0; a batch changed afterwards (``replace``, a direct
    construction) is checked again where the loss divides the logits by tau: tau = 0 would give
    inf logits and a NaN loss, so it is one clear error, as at ``create``."""
    from trainer_jax.objective import ObjectiveConfig, TokenBatch, policy_loss

    batch = TokenBatch.create(
        token_ids=[1, 2], behavior_logprob=[-1.0, -1.0], head_ids=[[1], [2]],
        head_logprobs=[[-1.0], [-1.0]], support_ids=[[-1], [-1]], support_logprobs=[[0.0], [0.0]],
        advantages=[1.0, 1.0], loss_mask=[1.0, 1.0], seq_ids=[0, 0], temperature=1.0)
    h, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    with pytest.raises(ValueError, match=rf"^TokenBatch.temperature must be > 0, got {tau}$"):
        policy_loss(h, w, batch.replace(temperature=tau), ObjectiveConfig())


@pytest.mark.parametrize(("c_min", "c_max"), [(0.25, 4.0), (0.5, 2.0), (0.0, 8.0)])
def test_mis_centering_tail_indicator_is_the_docstring_rule_at_its_bounds(c_min, c_max):
    """``centering_mis``'s tail factor alpha = 1[c_min <= 1/rho <= c_max] (0 at rho = 0), against
    that rule in exact fractions, on rho exactly at 1/c_max and 1/c_min (both inclusive, as the
    head's ``_in_range`` is) and around them. The head term is switched off (r above c_max), so
    the coefficient is -alpha p."""
    from fractions import Fraction

    from trainer_jax.objective.weights import centering_mis

    grid = {0.0, 0.0625, 0.125, 0.25, 0.375, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0}
    rho = np.array(sorted(grid | {1.0 / c_max} | ({1.0 / c_min} if c_min > 0 else set())), np.float32)
    p = np.full_like(rho, 0.5)
    r = np.full_like(rho, 100.0)  # p / b: above every c_max here
    coef = np.asarray(centering_mis(jnp.asarray(p), jnp.asarray(p / r), jnp.asarray(r), jnp.asarray(rho),
                                    c_min, c_max))

    def alpha(x: float) -> int:
        x = Fraction(x)
        return int(x > 0 and Fraction(c_min) <= 1 / x <= Fraction(c_max))

    want = [-0.5 * alpha(float(x)) for x in rho]
    assert coef.tolist() == want, list(zip(rho.tolist(), coef.tolist(), want, strict=True))
