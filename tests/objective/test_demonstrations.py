"""Issue 3 part 3: why the corrections matter, with exact expectations over x ~ b.

Every expectation enumerates the vocabulary (one batch row per (position, token) weighted by
b(x) through the advantage, ``constant`` aggregation), so there is no sampling noise: "zero" means
zero to float32 precision relative to the uncorrected drift.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer_jax.objective import ObjectiveConfig, TokenBatch, policy_loss, token_terms

T, D, V, K, TAU = 3, 12, 61, 8, 0.8
ZERO_TOL = 3e-6  # |E grad| / |uncorrected E grad| counted as "zero" in float32


def _cfg(**kw: object) -> ObjectiveConfig:
    return ObjectiveConfig(aggregation="constant", constant_normalizer=1.0, **kw)


_GRADS: dict[tuple[int, ObjectiveConfig], tuple[jax.Array, jax.Array]] = {}


def _expected_grad(problem, pos: np.ndarray, batch: TokenBatch, cfg: ObjectiveConfig):
    """Exact E_{x~b}[grad l] (summed over positions) for (hidden, lm_head); cached per config."""
    key = (id(batch), cfg)
    if key not in _GRADS:
        _GRADS[key] = _compute_expected_grad(problem, pos, batch, cfg)
    return _GRADS[key]


def _compute_expected_grad(problem, pos: np.ndarray, batch: TokenBatch, cfg: ObjectiveConfig):
    h = jnp.asarray(problem.hidden)
    w = jnp.asarray(problem.lm_head)
    f = jax.jit(lambda h, w: policy_loss(h[pos], w, batch, cfg)[0])
    return jax.grad(f, argnums=(0, 1))(h, w)


def _norm(g) -> float:
    return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in g)))


def _kl(b: np.ndarray, hidden: np.ndarray, lm_head: np.ndarray, softmax_np) -> float:
    p = softmax_np(hidden.astype(np.float64) @ lm_head.astype(np.float64) / TAU)
    m = b > 0
    return float(np.sum(b[m] * (np.log(b[m]) - np.log(p[m]))))


@pytest.fixture(scope="module")
def truncated(helpers):
    """Truncation active at every position: S_t = top-p(0.8) of q_t, b_t = q_t / q_t(S_t) on S_t."""
    rng = np.random.default_rng(7)
    prob = helpers["Problem"](rng, T, D, V, TAU, noise=1.5)
    b, sup, head, head_q = [], [], [], []
    for t in range(T):
        q = prob.q[t]
        s = helpers["top_p_set"](q, 0.8, V)
        bt = np.zeros(V)
        bt[s] = q[s] / q[s].sum()
        b.append(bt)
        sup.append(s)
        h = np.argsort(-q)[:K]
        head.append(h)
        head_q.append(q[h])
    pos, batch = helpers["make_rows"](prob, b, sup, head, head_q)
    return prob, np.stack(b), pos, batch


@pytest.fixture(scope="module")
def tail_proportional(helpers):
    """No truncation; head = K random ids with arbitrary b, tail of b exactly rho * p."""
    rng = np.random.default_rng(8)
    prob = helpers["Problem"](rng, T, D, V, TAU, noise=1.5)
    b, head, head_q = [], [], []
    for t in range(T):
        p = prob.p[t]
        h = rng.choice(V, K, replace=False)
        bt = np.zeros(V)
        bt[h] = rng.dirichlet(np.ones(K)) * 0.6
        tail = np.ones(V, bool)
        tail[h] = False
        bt[tail] = 0.4 * p[tail] / p[tail].sum()
        b.append(bt)
        head.append(h)
        head_q.append(bt[h])
    pos, batch = helpers["make_rows"](prob, b, [None] * T, head, head_q)
    return prob, np.stack(b), pos, batch


def test_uncorrected_gradient_moves_p_toward_b(truncated, helpers):
    prob, b, pos, batch = truncated
    gh, gw = _expected_grad(prob, pos, batch, _cfg(is_mode="none", score_centering=False, top_p_replay=False))

    # With w = 1, C = 0, A = 1: E_b[l] = -sum_t sum_x b log p = sum_t KL(b_t || p_t) + const,
    # so the expected update is exactly gradient descent on KL(b || p): drift toward b.
    def kl_total(h, w):
        logp = jax.nn.log_softmax(jnp.dot(h, w, precision="highest") / TAU, axis=-1)
        return -jnp.sum(jnp.asarray(b, jnp.float32) * logp)

    kh, kw = jax.grad(kl_total, argnums=(0, 1))(jnp.asarray(prob.hidden), jnp.asarray(prob.lm_head))
    assert _norm((gh, gw)) > 0.1
    np.testing.assert_allclose(gh, kh, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gw, kw, rtol=1e-4, atol=1e-5)
    step = 1e-2 / _norm((gh, gw))
    before = sum(_kl(b[t], prob.hidden[t], prob.lm_head, helpers["softmax_np"]) for t in range(T))
    h2 = prob.hidden - step * np.asarray(gh)
    w2 = prob.lm_head - step * np.asarray(gw)
    after = sum(_kl(b[t], h2[t], w2, helpers["softmax_np"]) for t in range(T))
    assert after < before - 1e-4


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "truncation-only"])
@pytest.mark.parametrize("mode", ["none", "mis", "tis"])
def test_score_centering_removes_drift(truncated, mode, replay):
    prob, _, pos, batch = truncated
    g_unc = _expected_grad(prob, pos, batch, _cfg(is_mode="none", score_centering=False, top_p_replay=replay))
    g_sc = _expected_grad(prob, pos, batch, _cfg(is_mode=mode, score_centering=True, top_p_replay=replay))
    assert _norm(g_sc) <= ZERO_TOL * _norm(g_unc), (_norm(g_sc), _norm(g_unc))


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "truncation-only"])
def test_plain_mis_reintroduces_drift(truncated, replay):
    prob, _, pos, batch = truncated
    cfg = _cfg(is_mode="mis", score_centering=False, top_p_replay=replay)
    terms = jax.jit(lambda h, w: token_terms(h[pos], w, batch, cfg))(
        jnp.asarray(prob.hidden), jnp.asarray(prob.lm_head)
    )
    out = (terms.ratio < cfg.c_min) | (terms.ratio > cfg.c_max)
    assert bool(out.any()) and not bool(out.all())  # the mismatch puts some x outside the range
    g_unc = _expected_grad(prob, pos, batch, _cfg(is_mode="none", score_centering=False, top_p_replay=replay))
    g_mis = _expected_grad(prob, pos, batch, cfg)
    # E_b[r 1[in] grad log p] = -sum_{x out of range} p grad log p != 0
    assert _norm(g_mis) > 1e-2 * _norm(g_unc)
    g_fixed = _expected_grad(prob, pos, batch, _cfg(is_mode="mis", score_centering=True, top_p_replay=replay))
    assert _norm(g_fixed) <= ZERO_TOL * _norm(g_unc)


@pytest.mark.parametrize("mode", ["none", "mis", "tis"])
def test_rho_tail_is_exact_when_b_tail_proportional_to_p(tail_proportional, mode):
    """Top-K head without truncation: SC is exact when b's tail really is rho * p."""
    prob, _, pos, batch = tail_proportional
    g_unc = _expected_grad(prob, pos, batch, _cfg(is_mode="none", score_centering=False))
    g_sc = _expected_grad(prob, pos, batch, _cfg(is_mode=mode, score_centering=True))
    assert _norm(g_unc) > 0.1
    assert _norm(g_sc) <= ZERO_TOL * _norm(g_unc), (_norm(g_sc), _norm(g_unc))


def test_mis_zeroes_tokens_outside_range(rng, helpers):
    n, d, v = 5, 10, 40
    prob = helpers["Problem"](rng, n, d, v, 1.0, noise=0.0)
    x = rng.integers(0, v, n)
    targets = np.array([0.1, 0.5, 1.0, 3.0, 7.0])  # r = p(x)/b(x) for each token
    logb = np.log(prob.p[np.arange(n), x]) - np.log(targets)
    batch = TokenBatch.create(
        token_ids=x,
        behavior_logprob=logb,
        head_ids=-np.ones((n, 1)),
        head_logprobs=np.full((n, 1), -np.inf),
        support_ids=-np.ones((n, 1)),
        support_logprobs=np.full((n, 1), -np.inf),
        advantages=np.ones(n),
        loss_mask=np.ones(n),
        seq_ids=np.arange(n),
        temperature=1.0,
    )
    cfg = ObjectiveConfig(is_mode="mis", score_centering=False)
    h, w = jnp.asarray(prob.hidden), jnp.asarray(prob.lm_head)
    terms = jax.jit(lambda h, w: token_terms(h, w, batch, cfg))(h, w)
    np.testing.assert_allclose(terms.ratio, targets, rtol=1e-4)
    outside = np.array([True, False, False, False, True])
    assert np.all(np.asarray(terms.weight)[outside] == 0)
    assert np.all(np.asarray(terms.loss)[outside] == 0)
    gh = jax.jit(jax.grad(lambda h: policy_loss(h, w, batch, cfg)[0]))(h)
    assert np.all(np.asarray(gh)[outside] == 0)
    assert np.all(np.abs(np.asarray(gh)[~outside]).max(axis=1) > 1e-4)


@pytest.mark.parametrize("mode,sc", [("none", False), ("none", True), ("mis", True), ("tis", True)])
def test_replay_gives_no_gradient_outside_support(rng, helpers, mode, sc):
    # lm_head = identity and hidden = logits * tau, so d loss / d hidden = d loss / d logits / tau.
    n, v, tau = 4, 30, 0.7
    logits = rng.normal(size=(n, v)) * 2
    q = helpers["softmax_np"](logits + rng.normal(size=(n, v)))
    sups, supl, x = [], [], []
    for t in range(n):
        s = helpers["top_p_set"](q[t], 0.7, 10)
        sups.append(np.pad(s, (0, 10 - len(s)), constant_values=-1))
        lb = np.log(q[t, s] / q[t, s].sum())
        supl.append(np.pad(lb, (0, 10 - len(s)), constant_values=-np.inf))
        x.append(s[0])
    sups, supl = np.stack(sups), np.stack(supl)
    batch = TokenBatch.create(
        token_ids=np.array(x),
        behavior_logprob=supl[:, 0],
        head_ids=np.argsort(-q, axis=1)[:, :5],
        head_logprobs=np.log(np.sort(q, axis=1)[:, ::-1][:, :5]),
        support_ids=sups,
        support_logprobs=supl,
        advantages=rng.normal(size=n),
        loss_mask=np.ones(n),
        seq_ids=np.arange(n),
        temperature=tau,
    )
    h = jnp.asarray(logits * tau, jnp.float32)
    eye = jnp.eye(v, dtype=jnp.float32)
    in_s = np.zeros((n, v), bool)
    for t in range(n):
        in_s[t, sups[t][sups[t] >= 0]] = True

    def grad(replay: bool, sc: bool = sc) -> np.ndarray:
        cfg = ObjectiveConfig(is_mode=mode, score_centering=sc, top_p_replay=replay)
        return np.asarray(jax.jit(jax.grad(lambda h: policy_loss(h, eye, batch, cfg)[0]))(h))

    g = grad(True)
    assert np.all(g[~in_s] == 0.0)
    assert np.abs(g[in_s]).max() > 1e-3
    # Without replay (and without centering, whose b-weighted softmax term cancels the sampled
    # one outside S) the full softmax is trained.
    assert np.abs(grad(False, sc=False)[~in_s]).max() > 1e-6


CONFIGS = [
    dict(is_mode="none", score_centering=False, top_p_replay=False),
    dict(is_mode="none", score_centering=True, top_p_replay=False),
    dict(is_mode="mis", score_centering=True, top_p_replay=True),
    dict(is_mode="mis", score_centering=False, top_p_replay=True),
    dict(is_mode="tis", score_centering=True, top_p_replay=True),
    dict(is_mode="tis", score_centering=True, top_p_replay=False),
]


def _ragged(rng, helpers, n=37, d=24, v=203, k=5, s=7):
    prob = helpers["Problem"](rng, n, d, v, 0.9, noise=1.0)
    batch = helpers["random_batch"](rng, prob, k=k, s_cap=s)
    return jnp.asarray(prob.hidden), jnp.asarray(prob.lm_head), batch


def _value_and_grads(h, w, batch, cfg):
    f = jax.jit(jax.value_and_grad(lambda h, w: policy_loss(h, w, batch, cfg)[0], argnums=(0, 1)))
    loss, (gh, gw) = f(h, w)
    return np.asarray(loss), np.asarray(gh), np.asarray(gw)


def _close(a: np.ndarray, ref: np.ndarray, rel: float) -> None:
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(a - ref).max())
    assert err <= rel * scale, f"max err {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_matches_dense_oracle(rng, helpers, kw):
    """The gathered / blocked / custom-vjp objective equals section 4 written with full logits."""
    h, w, batch = _ragged(rng, helpers)
    cfg = ObjectiveConfig(impl="reference", gather_block_size=5, **kw)  # 37 = 7 * 5 + 2
    loss, gh, gw = _value_and_grads(h, w, batch, cfg)
    oracle = jax.jit(
        jax.value_and_grad(lambda h, w: helpers["dense_oracle_loss"](h, w, batch, cfg), argnums=(0, 1))
    )
    o_loss, (o_gh, o_gw) = oracle(h, w)
    _close(loss, np.asarray(o_loss), 1e-5)
    _close(gh, np.asarray(o_gh), 1e-5)
    _close(gw, np.asarray(o_gw), 1e-5)


def _pallas_available() -> bool:
    try:
        from trainer_jax.kernels import LINEAR_LOGSUMEXP_IMPLS

        return "pallas" in LINEAR_LOGSUMEXP_IMPLS
    except ImportError:
        return False


_REFERENCE: dict[tuple, tuple[np.ndarray, ...]] = {}
IMPL_CASES = [
    ("xla", ()),
    ("xla", (("block_v", 64),)),  # 203 = 3 * 64 + 11: a remainder tile
    ("pallas", ()),
    ("pallas", (("block_n", 16), ("block_v", 64))),  # 37 tokens: a ragged token block
]


@pytest.mark.parametrize("impl,options", IMPL_CASES, ids=lambda x: str(x) if x else "default")
@pytest.mark.parametrize("kw", CONFIGS[1:4], ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_impls_agree(rng, helpers, kw, impl, options):
    if impl == "pallas" and not _pallas_available():
        pytest.skip("pallas implementation not importable")
    h, w, batch = _ragged(rng, helpers)  # the same problem for every case (fixed seed)
    key = tuple(kw.items())
    if key not in _REFERENCE:
        _REFERENCE[key] = _value_and_grads(h, w, batch, ObjectiveConfig(impl="reference", **kw))
    ref = _REFERENCE[key]
    cfg = ObjectiveConfig(impl=impl, kernel_options=options, **kw)
    got = _value_and_grads(h, w, batch, cfg)
    for a, b in zip(got, ref, strict=True):
        _close(a, b, 1e-5)


def test_unknown_kernel_option_is_rejected(rng, helpers):
    h, w, batch = _ragged(rng, helpers, n=4, d=8, v=16, k=2, s=2)
    cfg = ObjectiveConfig(impl="reference", kernel_options=(("block_v", 64),))
    with pytest.raises(ValueError, match="block_v"):
        policy_loss(h, w, batch, cfg)
