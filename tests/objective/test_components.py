"""Registries, aggregations, advantages, metrics, config validation and edge cases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest

from trainer_jax.objective import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    IMPORTANCE_WEIGHTS,
    SCORE_CENTERING,
    ObjectiveConfig,
    Ratios,
    Registry,
    TokenBatch,
    compute_advantages,
    policy_loss,
    reduce_metrics,
    sum_metrics,
    token_terms,
    weights,
)

# ---------------------------------------------------------------- registries / variants


def test_registry_register_get_and_errors():
    reg: Registry = Registry("thing")

    @reg.register("a")
    def a() -> int:
        return 1

    assert reg.get("a") is a and "a" in reg and reg.names() == ("a",)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(a)
    with pytest.raises(KeyError, match="unknown thing 'b'; registered: a"):
        reg.get("b")
    assert set(IMPORTANCE_WEIGHTS.names()) == {"none", "tis", "mis", "seq_tis", "seq_mis", "geo_mask"}
    assert set(SCORE_CENTERING) == {"none", "tis", "mis", "geo_mask"}
    assert set(AGGREGATIONS) == {"token_mean", "seq_mean_token_mean", "constant"}
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "grpo_mean"}
    for reg_ in (IMPORTANCE_WEIGHTS, SCORE_CENTERING, AGGREGATIONS, ADVANTAGE_ESTIMATORS):
        for name in reg_:
            assert reg_.get(name).__doc__, f"{name} must state its math"


def _token_weights(mode: str, r, cfg: ObjectiveConfig | None = None):
    """A token mode's weights for ratios ``r`` (each token its own sample, all scored)."""
    r = jnp.asarray(r, jnp.float32)
    flat = r.reshape(-1)
    ratios = Ratios(jnp.log(flat), jnp.ones(flat.shape, bool), jnp.arange(flat.shape[0]))
    return IMPORTANCE_WEIGHTS.get(mode)(ratios, cfg or ObjectiveConfig()).weight.reshape(r.shape)


def test_weights():
    r = jnp.array([0.1, 0.2, 1.0, 5.0, 6.0])
    # The plain functions of r, boundaries included (closed range).
    np.testing.assert_allclose(weights.tis(r, 5.0), [0.1, 0.2, 1.0, 5.0, 5.0])
    np.testing.assert_allclose(weights.mis(r, 0.2, 5.0), [0.0, 0.2, 1.0, 5.0, 0.0])
    # MIS never multiplies an infinite ratio by zero.
    assert weights.mis(jnp.array([jnp.inf]), 0.2, 5.0)[0] == 0
    # Through the registry (which reads log r): away from the boundaries exp(log r) rounds.
    r = jnp.array([0.1, 0.21, 1.0, 4.9, 6.0])
    np.testing.assert_array_equal(_token_weights("none", r), np.ones(5))
    np.testing.assert_allclose(_token_weights("tis", r), [0.1, 0.21, 1.0, 4.9, 5.0], rtol=1e-6)
    np.testing.assert_allclose(_token_weights("mis", r), [0.0, 0.21, 1.0, 4.9, 0.0], rtol=1e-6)


@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
def test_centering_is_b_w_minus_rho_w_inv_rho_p(mode):
    """Every SC variant is coef = b w(p/b) - rho w(1/rho) p (and its rho -> 0 limit)."""
    rng = np.random.default_rng(0)
    p = jnp.asarray(rng.uniform(0.001, 0.3, (6, 9)), jnp.float32)
    b = jnp.asarray(rng.uniform(0.001, 0.3, (6, 9)), jnp.float32)
    r = p / b
    rho = jnp.asarray([[0.05], [0.19], [0.5], [1.0], [3.0], [7.0]], jnp.float32)
    c_min, c_max = 0.2, 5.0

    def w(x, c_min, c_max):
        return _token_weights(mode, x, ObjectiveConfig(c_min=c_min, c_max=c_max))

    coef = SCORE_CENTERING.get(mode)(p, b, r, rho, c_min, c_max)
    np.testing.assert_allclose(
        coef, b * w(r, c_min, c_max) - rho * w(1 / rho, c_min, c_max) * p, rtol=1e-6, atol=1e-7
    )
    coef0 = SCORE_CENTERING.get(mode)(p, b, r, jnp.zeros_like(rho), c_min, c_max)
    np.testing.assert_allclose(coef0, b * w(r, c_min, c_max), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- aggregations / advantages


def test_aggregations():
    ell = jnp.array([1.0, 2.0, 3.0, 4.0, 100.0, 6.0])
    mask = jnp.array([1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    seq = jnp.array([0, 0, 0, 1, 1, 3])  # seq 2 absent; seq 1 has one live token
    cfg = ObjectiveConfig(aggregation="constant", constant_normalizer=4.0)
    assert float(AGGREGATIONS.get("token_mean")(ell, mask, seq, cfg)) == pytest.approx(16 / 5)
    smtm = AGGREGATIONS.get("seq_mean_token_mean")(ell, mask, seq, cfg)
    assert float(smtm) == pytest.approx((2.0 + 4.0 + 6.0) / 3)
    assert float(AGGREGATIONS.get("constant")(ell, mask, seq, cfg)) == pytest.approx(16 / 4)
    zero = jnp.zeros(6)
    assert float(AGGREGATIONS.get("token_mean")(ell, zero, seq, cfg)) == 0.0
    assert float(AGGREGATIONS.get("seq_mean_token_mean")(ell, zero, seq, cfg)) == 0.0


def test_advantages():
    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    np.testing.assert_allclose(compute_advantages(rewards, "grpo"), [[1, -1, -1, 1], [0, 0, 0, 0]], atol=1e-5)
    np.testing.assert_allclose(
        compute_advantages(rewards, "grpo_mean"), [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]]
    )
    r = np.random.default_rng(0).normal(size=(3, 8))
    a = np.asarray(compute_advantages(r, "grpo", eps=0.0))
    np.testing.assert_allclose(a.mean(1), 0, atol=1e-6)
    np.testing.assert_allclose(a.std(1), 1, atol=1e-5)
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        compute_advantages(jnp.zeros(4))
    with pytest.raises(KeyError, match="advantage estimator"):
        compute_advantages(rewards, "ppo")


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(is_mode="bogus"), "unknown importance-weight mode .bogus."),
        (dict(aggregation="sum"), "unknown aggregation .sum."),
        (dict(impl="cuda"), "impl"),
        (dict(c_min=2.0, c_max=1.0), "c_min < c_max"),
        (dict(c_min=-0.1), "c_min"),
        (dict(c_max=float("inf")), "finite"),
        (dict(is_mode="mis", c_min=1.5, c_max=3.0), "c_min <= 1 <= c_max"),
        (dict(constant_normalizer=0.0), "constant_normalizer"),
        (dict(num_groups=0), "num_groups"),
        (dict(min_tail_mass=0.0), "min_tail_mass"),
        (dict(gather_block_size=0), "gather_block_size"),
        (dict(unknown_field=1), "unknown_field"),
        (dict(kernel_options=(("block_v", 64), ("block_v", 32))), "repeated"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        ObjectiveConfig(**kw)


def test_config_is_frozen_and_hashable():
    cfg = ObjectiveConfig(is_mode="tis", c_min=1.5, c_max=3.0)  # TIS has no range constraint
    assert hash(cfg) == hash(ObjectiveConfig(is_mode="tis", c_min=1.5, c_max=3.0))
    with pytest.raises(pydantic.ValidationError):
        cfg.is_mode = "none"  # type: ignore[misc]
    assert ObjectiveConfig().c_min == 0.2 and ObjectiveConfig().c_max == 5.0


# ---------------------------------------------------------------- metrics


def _problem(rng, helpers, n=24, d=16, v=90, k=6, s=6, groups=3):
    prob = helpers["Problem"](rng, n, d, v, 1.1, noise=1.0)
    batch = helpers["random_batch"](rng, prob, k=k, s_cap=s, num_groups=groups)
    return jnp.asarray(prob.hidden), jnp.asarray(prob.lm_head), batch


def _rows(batch: TokenBatch, sl: slice) -> TokenBatch:
    return jax.tree.map(lambda x: x[sl] if getattr(x, "ndim", 0) >= 1 else x, batch)


def test_metrics_reduce_over_half_batches_and_groups(rng, helpers):
    h, w, batch = _problem(rng, helpers)
    cfg = ObjectiveConfig(num_groups=3)
    f = jax.jit(lambda h, w, b: policy_loss(h, w, b, cfg)[1])
    whole = f(h, w, batch)
    halves = sum_metrics(
        f(h[:12], w, _rows(batch, slice(0, 12))), f(h[12:], w, _rows(batch, slice(12, None)))
    )
    assert set(whole) == set(halves)
    for key in whole:
        for a, b in zip(whole[key], halves[key], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=key)
    # Per-group sums and counts add up to the overall ones (every group id is in range).
    for key in ("k1", "k3", "head_kl", "entropy", "rho", "tokens", "out_of_range"):
        np.testing.assert_allclose(whole[f"group/{key}"].sum.sum(), whole[key].sum, rtol=1e-5)
        np.testing.assert_allclose(whole[f"group/{key}"].count.sum(), whole[key].count)
    means = reduce_metrics(whole)
    assert float(means["tokens"]) == float(jnp.sum(batch.loss_mask))
    assert 0.0 <= float(means["out_of_range"]) <= 1.0
    assert float(means["head_kl"]) >= 0.0 and float(means["k3"]) >= 0.0


def test_metric_values_and_empty_group(helpers):
    rng = np.random.default_rng(3)
    h, w, batch = _problem(rng, helpers, groups=2)
    batch = batch.replace(group_ids=jnp.zeros_like(batch.group_ids))  # group 1 and 2 empty
    cfg = ObjectiveConfig(num_groups=3, top_p_replay=False)
    terms = jax.jit(lambda h, w: token_terms(h, w, batch, cfg))(h, w)
    means = reduce_metrics(jax.jit(lambda h, w: policy_loss(h, w, batch, cfg)[1])(h, w))
    g = means["group/k1"]
    assert np.isfinite(g[0]) and np.all(np.isnan(g[1:]))
    valid = np.asarray(terms.valid)
    logb = np.asarray(batch.behavior_logprob)[valid]
    k1 = logb - np.asarray(terms.logp)[valid]
    np.testing.assert_allclose(means["k1"], k1.mean(), rtol=1e-5)
    r = np.exp(-k1)
    np.testing.assert_allclose(means["k3"], (r - 1 + k1).mean(), rtol=1e-4)
    np.testing.assert_allclose(means["out_of_range"], ((r < 0.2) | (r > 5)).mean(), rtol=1e-6)
    # Truncated tokens: rho = 0 and sum_H b = 1; head_kl = KL(b || p) exactly there.
    rho = np.asarray(terms.rho)
    trunc = np.asarray(terms.truncated)
    assert np.all(rho[trunc] == 0) and np.all(rho[~trunc] > 0)


# ---------------------------------------------------------------- edge cases


def _single(**over):
    """Four tokens, V = 12: rows 0/1 truncated, 2 top-K head, 3 empty head and no truncation."""
    with np.errstate(divide="ignore"):  # log(0) = -inf marks padding
        return _single_batch(**over)


def _single_batch(**over):
    base = dict(
        token_ids=[3, 5, 7, 2],
        behavior_logprob=np.log([0.5, 0.3, 0.1, 0.05]),
        head_ids=[[0, 1, -1], [0, 1, -1], [7, 8, 9], [-1, -1, -1]],
        head_logprobs=np.log([[0.2, 0.1, 0], [0.2, 0.1, 0], [0.1, 0.3, 0.2], [0, 0, 0]]),
        support_ids=[[3, 4, -1], [5, 6, 3], [-1, -1, -1], [-1, -1, -1]],
        support_logprobs=np.log([[0.5, 0.5, 0], [0.3, 0.3, 0.4], [0, 0, 0], [0, 0, 0]]),
        advantages=[1.0, -0.5, 2.0, 1.0],
        loss_mask=[1.0, 1.0, 1.0, 1.0],
        seq_ids=[0, 0, 1, 1],
        temperature=0.9,
    )
    base.update(over)
    return TokenBatch.create(**base)


def _finite_grads(batch, cfg, h=None, w=None):
    rng = np.random.default_rng(5)
    h = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32) if h is None else h
    w = jnp.asarray(rng.normal(size=(6, 12)), jnp.float32) if w is None else w
    f = jax.jit(jax.value_and_grad(lambda h, w: policy_loss(h, w, batch, cfg), argnums=(0, 1), has_aux=True))
    (loss, metrics), (gh, gw) = f(h, w)
    assert np.isfinite(loss) and np.all(np.isfinite(gh)) and np.all(np.isfinite(gw))
    for k, m in metrics.items():
        assert np.all(np.isfinite(m.sum)) and np.all(np.isfinite(m.count)), k
    return loss, metrics, gh, gw


@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
@pytest.mark.parametrize("replay", [True, False])
def test_edge_rows_are_finite(mode, replay):
    cfg = ObjectiveConfig(is_mode=mode, top_p_replay=replay)
    batch = _single()
    _finite_grads(batch, cfg)
    terms = token_terms(jnp.ones((4, 6)) * 0.1, jnp.ones((6, 12)) * 0.1, batch, cfg)
    # Empty head without truncation: nothing known about b beyond x, rho = 1, no centering.
    assert float(terms.rho[3]) == 1.0 and float(terms.centering[3]) == 0.0
    assert np.all(np.asarray(terms.rho[:2]) == 0.0)


def test_loss_mask_zero_gives_zero_gradient_even_with_garbage():
    cfg = ObjectiveConfig()
    batch = _single(
        loss_mask=[0.0, 1.0, 0.0, 0.0],
        behavior_logprob=[-np.inf, np.log(0.3), np.nan, np.inf],
        advantages=[np.nan, 1.0, np.inf, 1.0],
    )
    loss, metrics, gh, _ = _finite_grads(batch, cfg)
    assert np.all(np.asarray(gh)[[0, 2, 3]] == 0.0)
    assert float(metrics["tokens"].sum) == 1.0 and float(metrics["dropped"].sum) == 0.0
    all_off = _single(loss_mask=[0.0] * 4)
    loss, _, gh, gw = _finite_grads(all_off, cfg)
    assert float(loss) == 0.0 and not np.any(gh) and not np.any(gw)


def test_inconsistent_records_are_dropped():
    # Row 0: x not in its support; row 2: behaviour log-prob NaN but loss-mask on; row 3: x = -1.
    batch = _single(token_ids=[9, 5, 7, -1], behavior_logprob=np.log([0.5, 0.3, np.nan, 0.05]))
    _, metrics, gh, _ = _finite_grads(batch, ObjectiveConfig())
    assert float(metrics["dropped"].sum) == 3.0 and float(metrics["tokens"].sum) == 1.0
    assert np.all(np.asarray(gh)[[0, 2, 3]] == 0.0)


def test_head_mass_close_to_one_keeps_rho_bounded():
    # One dominant logit: sum_H p = 1 - O(1e-9) in float64, i.e. 1 in float32.
    w = jnp.zeros((6, 12)).at[0, 7].set(30.0)
    h = jnp.zeros((4, 6)).at[:, 0].set(1.0)
    batch = _single()
    cfg = ObjectiveConfig(is_mode="none", top_p_replay=False)
    _finite_grads(batch, cfg, h=h, w=w)
    rho = token_terms(h, w, batch, cfg).rho
    # Row 2: 1 - sum_H b = 0.4, trainer tail mass floored at min_tail_mass.
    assert float(rho[2]) == pytest.approx(0.4 / cfg.min_tail_mass, rel=1e-5)


def test_shape_errors():
    batch = _single()
    with pytest.raises(ValueError, match="hidden has 3 rows"):
        policy_loss(jnp.ones((3, 6)), jnp.ones((6, 12)), batch, ObjectiveConfig())
    with pytest.raises(ValueError, match=r"lm_head \[D, V\]"):
        policy_loss(jnp.ones((4, 6)), jnp.ones((5, 12)), batch, ObjectiveConfig())
    bad = batch.replace(head_logprobs=batch.head_logprobs[:, :2])
    with pytest.raises(ValueError, match="head_logprobs"):
        policy_loss(jnp.ones((4, 6)), jnp.ones((6, 12)), bad, ObjectiveConfig())
    with pytest.raises(ValueError, match="temperature"):
        _single(temperature=0.0)


def test_bf16_inputs(rng, helpers):
    h, w, batch = _problem(rng, helpers)
    cfg = ObjectiveConfig()
    f = jax.jit(jax.value_and_grad(lambda h, w: policy_loss(h, w, batch, cfg)[0], argnums=(0, 1)))
    loss32, _ = f(h, w)
    loss16, (gh, gw) = f(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    assert loss16.dtype == jnp.float32
    assert float(loss16) == pytest.approx(float(loss32), rel=0.05, abs=0.05)
