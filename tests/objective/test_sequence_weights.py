"""Issue 48 item 1: sequence-level corrections (seq_tis, seq_mis, geo_mask).

The oracle is written independently of ``trainer_jax.objective``: float64 numpy, full softmax,
one loop per sample for the sequence ratio and one loop per token for the loss and its gradient
with respect to the hidden states (d log p(x) / d h = (W[:, x] - W pi) / tau, pi the normalising
distribution: p, or p-hat on S under replay).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest

from trainer_jax.batching import Sample, pack
from trainer_jax.config import ConfigError, load_config
from trainer_jax.objective import ObjectiveConfig, TokenBatch, policy_loss, reduce_metrics, token_terms

D, V, K, S_CAP, TAU = 10, 40, 6, 5, 0.9
C_MIN, C_MAX = 0.2, 5.0


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# Samples: (length, per-token log-ratio offsets delta_t = log p(x_t) - log b(x_t)).
# Chosen so every mode sees samples on both sides of its thresholds:
#   A  small noise           R ~ 1       kept by all
#   B  log R = +3 over 10    R = 20      seq_tis capped, seq_mis masked, G = e^0.3 > 1.25 masked
#   C  log R = -2 over 8     R = 0.135   seq_mis masked (< 0.2), G = e^-0.25 < 0.8 masked
#   D  log R = +120 over 60  overflows float32 if exponentiated; G = e^2 masked
#   E  log R = -120 over 60  underflows; masked by seq_mis and geo_mask
#   F  one token at +2 (r = 7.4, MIS masks it), the rest ~0: geo keeps the sample (G ~ e^0.2)
#   G  log R = +1.2 over 12  R = 3.3: kept by seq_mis; G = e^0.1 kept
def _deltas(rng: np.random.Generator) -> list[np.ndarray]:
    return [
        rng.normal(0, 0.05, 6),
        np.full(10, 0.3),
        np.full(8, -0.25),
        np.full(60, 2.0),
        np.full(60, -2.0),
        np.r_[2.0, np.zeros(9)],
        np.full(12, 0.1),
    ]


def _problem(seed: int = 0, groups: int = 2):
    """A flat batch of the samples above, with environment tokens (loss mask 0, garbage record)
    inside samples and padding rows (seq id 0, loss mask 0) at the end, as ``pack`` lays it out."""
    rng = np.random.default_rng(seed)
    deltas = _deltas(rng)
    rows = []  # (seq, delta or None for a masked token)
    for s, d in enumerate(deltas):
        for i, x in enumerate(d):
            rows.append((s, x))
            if i == 2 and s % 2 == 0:  # a tool reply in the middle of a multi-turn sample
                rows.extend([(s, None)] * 2)
    rows.extend([(0, None)] * 5)  # padding of the token bucket
    n = len(rows)
    hidden = rng.normal(size=(n, D))
    lm_head = rng.normal(size=(D, V)) * 1.5 / np.sqrt(D)
    tok, logb, heads, headl, sups, supl, mask, seq = [], [], [], [], [], [], [], []
    for t, (s, delta) in enumerate(rows):
        h32 = hidden[t].astype(np.float32).astype(np.float64)
        w32 = lm_head.astype(np.float32).astype(np.float64)
        p = _softmax(h32 @ w32 / TAU)
        q = _softmax(np.log(p) + rng.normal(0, 0.7, V))
        truncated = t % 3 == 0
        if truncated:
            sup = np.argsort(-q)[:S_CAP]
            b_s = q[sup] / q[sup].sum()
            x = int(sup[rng.integers(0, S_CAP)])
            logp_x = np.log(p[x] / p[sup].sum())  # replay: p-hat
            sups.append(sup)
            supl.append(np.log(b_s))
        else:
            x = int(rng.integers(0, V))
            logp_x = np.log(p[x])
            sups.append(np.array([], np.int64))
            supl.append(np.array([]))
        head = np.argsort(-q)[:K]
        heads.append(head)
        headl.append(np.log(q[head]))
        tok.append(x)
        if delta is None:
            logb.append(np.nan if t % 2 else np.inf)  # garbage a masked token must not spread
            mask.append(0.0)
        else:
            logb.append(logp_x - delta)
            mask.append(1.0)
        seq.append(s)
    pad = lambda rs, w, fill: np.array([np.r_[r, np.full(w - len(r), fill)] for r in rs])  # noqa: E731
    batch = TokenBatch.create(
        token_ids=np.array(tok), behavior_logprob=np.array(logb),
        head_ids=pad(heads, K, -1), head_logprobs=pad(headl, K, -np.inf),
        support_ids=pad(sups, S_CAP, -1), support_logprobs=pad(supl, S_CAP, -np.inf),
        advantages=rng.normal(size=n), loss_mask=np.array(mask), seq_ids=np.array(seq),
        temperature=TAU, group_ids=np.array([(s // 2) % groups for s, _ in rows]),
    )
    return hidden.astype(np.float32), lm_head.astype(np.float32), batch, len(deltas)


def _np(x) -> np.ndarray:
    return np.asarray(x, np.float64)


def oracle(hidden, lm_head, batch: TokenBatch, cfg: ObjectiveConfig):
    """float64 reference: (loss, d loss / d hidden, per-token weights, per-sample keep)."""
    h, w = _np(hidden), _np(lm_head)
    n = h.shape[0]
    tau = batch.temperature
    tok, logb_x, adv = np.asarray(batch.token_ids), _np(batch.behavior_logprob), _np(batch.advantages)
    mask, seq = np.asarray(batch.loss_mask), np.asarray(batch.seq_ids)
    sup_ids, sup_lb = np.asarray(batch.support_ids), _np(batch.support_logprobs)
    head_ids, head_lb = np.asarray(batch.head_ids), _np(batch.head_logprobs)
    log_r = np.zeros(n)
    valid = np.zeros(n, bool)
    norm_set, lp_all = [], []
    for t in range(n):
        z = h[t] @ w / tau
        s = sup_ids[t][sup_ids[t] >= 0]
        if len(s) and cfg.top_p_replay:
            lp = np.full(V, -np.inf)
            lp[s] = z[s] - np.log(np.sum(np.exp(z[s])))
            norm_set.append(s)
        else:
            lp = z - np.log(np.sum(np.exp(z)))
            norm_set.append(np.arange(V))
        lp_all.append(lp)
        valid[t] = mask[t] > 0 and np.isfinite(logb_x[t]) and (not len(s) or tok[t] in s)
        if valid[t]:
            log_r[t] = lp[tok[t]] - logb_x[t]
    # ---- sequence ratios: one loop per sample over its scored tokens
    weight, keep = np.zeros(n), np.ones(n)
    for s in np.unique(seq):
        members = [t for t in range(n) if seq[t] == s and valid[t]]
        if not members:
            continue
        big = math.fsum(log_r[t] for t in members)
        for t in members:
            r_t = math.exp(log_r[t])
            if cfg.is_mode == "seq_tis":
                weight[t] = math.exp(min(big, math.log(cfg.c_max)))
            elif cfg.is_mode == "seq_mis":
                inside = math.log(cfg.c_min) <= big <= math.log(cfg.c_max)
                weight[t], keep[t] = (math.exp(big), 1.0) if inside else (0.0, 0.0)
            elif cfg.is_mode == "geo_mask":
                g = math.exp(big / len(members))
                if cfg.geo_min <= g <= cfg.geo_max:
                    weight[t] = r_t if cfg.c_min <= r_t <= cfg.c_max else 0.0
                else:
                    weight[t], keep[t] = 0.0, 0.0
            else:
                raise AssertionError(cfg.is_mode)
    # ---- loss and gradient, token by token
    count = max(valid.sum(), 1)
    loss, grad = 0.0, np.zeros_like(h)
    for t in np.nonzero(valid)[0]:
        lp = lp_all[t]
        ns = norm_set[t]
        pi = np.exp(lp[ns])
        w_mean = w[:, ns] @ pi

        def dlogp(x):
            return (w[:, x] - w_mean) / tau  # noqa: B023

        cen, dcen = 0.0, np.zeros(h.shape[1])
        if cfg.score_centering:
            s = sup_ids[t][sup_ids[t] >= 0]
            if len(s):  # truncated: H = S, exact b, rho = 0 (alpha = 0)
                ids, b_h, rho = s, np.exp(sup_lb[t][: len(s)]), 0.0
            else:
                ids = head_ids[t][head_ids[t] >= 0]
                b_h = np.exp(head_lb[t][: len(ids)])
                p_h = np.exp(lp[ids])
                rho = (1 - b_h.sum()) / max(1 - p_h.sum(), cfg.min_tail_mass)
            alpha = 1.0 if rho > 0 and cfg.c_min <= 1 / rho <= cfg.c_max else 0.0
            for x, bx in zip(ids, b_h, strict=True):
                px = math.exp(lp[x])
                coef = (px if cfg.c_min <= px / bx <= cfg.c_max else 0.0) - alpha * px
                cen += coef * lp[x]
                dcen += coef * dlogp(x)
        loss += -adv[t] * (weight[t] * lp[tok[t]] - keep[t] * cen) / count
        grad[t] = -adv[t] * (weight[t] * dlogp(tok[t]) - keep[t] * dcen) / count
    return loss, grad, weight, valid


CASES = [
    dict(is_mode="seq_tis", score_centering=False),
    dict(is_mode="seq_mis", score_centering=False),
    dict(is_mode="geo_mask", score_centering=False),
    dict(is_mode="geo_mask", score_centering=True),
]


@pytest.fixture(scope="module")
def problem():
    return _problem()


_COMPILED: dict = {}


def _cfg(mode: str) -> ObjectiveConfig:
    return ObjectiveConfig(is_mode=mode, score_centering=False, num_groups=2)


def run(hidden, lm_head, batch: TokenBatch, cfg: ObjectiveConfig):
    """(loss, d loss / d hidden, terms, reduced metrics) in one compiled call per config."""
    if cfg not in _COMPILED:

        def f(h, w, b):
            (loss, metrics), grad = jax.value_and_grad(lambda h: policy_loss(h, w, b, cfg), has_aux=True)(h)
            return loss, grad, token_terms(h, w, b, cfg), metrics

        _COMPILED[cfg] = jax.jit(f)
    loss, grad, terms, metrics = _COMPILED[cfg](jnp.asarray(hidden), jnp.asarray(lm_head), batch)
    return loss, grad, terms, reduce_metrics(metrics)


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_matches_float64_oracle(problem, kw):
    hidden, lm_head, batch, _ = problem
    cfg = ObjectiveConfig(**kw, num_groups=2)
    o_loss, o_grad, o_w, o_valid = oracle(hidden, lm_head, batch, cfg)
    loss, grad, terms, _ = run(hidden, lm_head, batch, cfg)
    np.testing.assert_array_equal(np.asarray(terms.valid), o_valid)
    np.testing.assert_allclose(np.asarray(terms.weight)[o_valid], o_w[o_valid], rtol=2e-4, atol=1e-6)
    assert float(loss) == pytest.approx(o_loss, rel=2e-4, abs=1e-6)
    np.testing.assert_allclose(np.asarray(grad), o_grad, rtol=2e-3, atol=2e-6)
    assert np.all(np.isfinite(np.asarray(grad)))
    # The cases do what the samples were built for (the oracle is not vacuous).
    if cfg.is_mode == "seq_tis":
        assert np.isclose(o_w[o_valid], C_MAX).any() and (o_w[o_valid] < C_MAX - 1e-6).any()
    else:
        assert (o_w[o_valid] == 0).any() and (o_w[o_valid] > 0).any()


def _sample_weights(batch, cfg, hidden, lm_head) -> dict[int, set[float]]:
    terms = run(hidden, lm_head, batch, cfg)[2]
    out: dict[int, set[float]] = {}
    for t in np.nonzero(np.asarray(terms.valid))[0]:
        out.setdefault(int(batch.seq_ids[t]), set()).add(round(float(terms.weight[t]), 5))
    return out


def test_thresholds_per_sample(problem):
    """Each sample's weight against the hand-computed value of its constructed log R."""
    hidden, lm_head, batch, _ = problem
    tis = _sample_weights(batch, _cfg("seq_tis"), hidden, lm_head)
    mis = _sample_weights(batch, _cfg("seq_mis"), hidden, lm_head)
    geo = _sample_weights(batch, _cfg("geo_mask"), hidden, lm_head)
    assert all(len(v) == 1 for v in tis.values()) and all(len(v) == 1 for v in mis.values())
    assert tis[1] == {5.0} and tis[3] == {5.0} and tis[4] == {0.0}  # capped; e^-120 underflows
    assert tis[2] == {round(math.exp(-2.0), 5)} and tis[6] == {round(math.exp(1.2), 5)}
    assert mis[1] == mis[2] == mis[3] == mis[4] == {0.0} and mis[6] == {round(math.exp(1.2), 5)}
    assert geo[1] == geo[2] == geo[3] == geo[4] == {0.0}
    assert 0.0 in geo[5] and len(geo[5]) > 1  # kept sample, its r = e^2 token masked by MIS
    assert geo[6] == {round(math.exp(0.1), 5)}


def test_metrics_masked_shares_and_ess(problem):
    hidden, lm_head, batch, num_samples = problem
    cfg = _cfg("seq_mis")
    _, _, o_w, valid = oracle(hidden, lm_head, batch, cfg)
    m = run(hidden, lm_head, batch, cfg)[3]
    seq, groups = np.asarray(batch.seq_ids), np.asarray(batch.group_ids)
    for g in range(2):
        sel = valid & (groups == g)
        w = o_w[sel]
        assert float(m["group/masked_tokens"][g]) == pytest.approx(np.mean(w == 0))
        assert float(m["group/ess"][g]) == pytest.approx(w.sum() ** 2 / (w**2).sum(), rel=1e-4)
        samples = np.unique(seq[sel])
        masked = [s for s in samples if np.all(o_w[valid & (seq == s)] == 0)]
        assert float(m["group/masked_seqs"][g]) == pytest.approx(len(masked) / len(samples))
    assert float(m["masked_seqs"]) == pytest.approx(5 / num_samples)  # B, C, D, E and F (R = e^2)
    w = o_w[valid]
    assert float(m["ess"]) == pytest.approx(w.sum() ** 2 / (w**2).sum(), rel=1e-4)


def test_padding_and_env_tokens_do_not_enter_the_ratio(problem):
    """Changing what masked tokens carry (behaviour log-prob, advantage, seq id of padding) and
    adding masked tokens to a sample changes no weight."""
    hidden, lm_head, batch, _ = problem
    cfg = _cfg("geo_mask")
    base = run(hidden, lm_head, batch, cfg)[2]
    off = np.asarray(batch.loss_mask) == 0
    other = batch.replace(
        behavior_logprob=jnp.where(jnp.asarray(off), -50.0, batch.behavior_logprob),
        seq_ids=jnp.where(jnp.asarray(off), 1, batch.seq_ids),
    )
    moved = run(hidden, lm_head, other, cfg)[2]
    on = ~off
    np.testing.assert_array_equal(np.asarray(base.weight)[on], np.asarray(moved.weight)[on])
    assert not np.any(np.asarray(base.loss)[off])


def test_two_samples_packed_in_one_row_keep_apart():
    """``pack`` puts two multi-turn samples in one row; each gets its own sequence ratio."""
    rng = np.random.default_rng(3)

    def sample(policy_logb: list[float], group: int) -> Sample:
        # prompt (2), 2 policy, 2 environment, 2 policy tokens
        lm = np.array([0, 0, 1, 1, 0, 0, 1, 1])
        p = int(lm.sum())
        return Sample(token_ids=rng.integers(0, V, 8), loss_mask=lm, logprobs=np.array(policy_logb),
                      head_ids=np.full((p, 2), -1), head_logprobs=np.full((p, 2), -np.inf),
                      support_indptr=np.zeros(p + 1, np.int32), support_ids=np.zeros(0, np.int32),
                      support_logprobs=np.zeros(0), versions=np.zeros(p, np.int64), group=group)

    a = sample([-9.0, -9.0, -9.0, -9.0], 0)  # b tiny: R huge, masked by seq_mis
    b = sample([-3.7, -3.7, -3.7, -3.7], 1)  # b ~ uniform over 40: R ~ 1
    inputs, batch, taken = pack([a, b], np.array([1.0, -1.0]), rows=1, row_len=16, max_tokens=12,
                                head_k=2, support_k=1, temperature=1.0, trainer_version=0)
    assert taken == [0, 1] and np.all(np.asarray(inputs.token_rows)[:8] == 0)  # one row, two samples
    seq = np.asarray(batch.seq_ids)
    assert list(seq[:8]) == [0] * 4 + [1] * 4
    hidden = rng.normal(size=(12, D)).astype(np.float32) * 0.1
    lm_head = rng.normal(size=(D, V)).astype(np.float32) * 0.1
    cfg = ObjectiveConfig(is_mode="seq_mis", score_centering=False)
    terms = run(hidden, lm_head, batch, cfg)[2]
    logp = np.asarray(terms.logp, np.float64)
    logb = np.asarray(batch.behavior_logprob, np.float64)
    for toks in (range(0, 4), range(4, 8)):
        big = sum(logp[t] - logb[t] for t in toks)
        want = math.exp(big) if math.log(C_MIN) <= big <= math.log(C_MAX) else 0.0
        np.testing.assert_allclose(np.asarray(terms.weight)[list(toks)], want, rtol=1e-4)
    assert float(terms.weight[0]) == 0.0 and float(terms.weight[4]) > 0.0
    assert not np.any(np.asarray(terms.valid)[8:])  # the bucket's padding


def test_out_of_range_seq_ids_are_dropped_for_sequence_modes(problem):
    hidden, lm_head, batch, _ = problem
    bad = batch.replace(seq_ids=batch.seq_ids.at[0].set(10_000))
    cfg = _cfg("seq_tis")
    terms = run(hidden, lm_head, bad, cfg)[2]
    good = run(hidden, lm_head, batch, cfg)[2]
    assert not bool(terms.valid[0]) and bool(good.valid[0])


@pytest.mark.parametrize("mode", ["seq_tis", "seq_mis"])
def test_centering_refused_with_sequence_ratio_modes(mode):
    refused = f"score_centering with is_mode '{mode}' is refused: .*continuation"
    with pytest.raises(pydantic.ValidationError, match=refused):
        ObjectiveConfig(is_mode=mode)
    ObjectiveConfig(is_mode=mode, score_centering=False)
    ObjectiveConfig(is_mode="geo_mask")  # composes


@pytest.mark.parametrize("kw,match", [
    (dict(geo_min=1.0), r"geo_min < 1 < geo_max"),
    (dict(geo_max=1.0), r"geo_min < 1 < geo_max"),
    (dict(geo_min=1.2, geo_max=1.5), r"geo_min < 1 < geo_max"),
    (dict(geo_max=float("inf")), "finite"),
    (dict(geo_min=-0.1), "geo_min"),
    (dict(is_mode="geo_mask", c_min=1.5, c_max=3.0), "geo_mask needs c_min <= 1 <= c_max"),
    (dict(is_mode="seq_mis", score_centering=False, c_min=1.5, c_max=3.0), "seq_mis needs c_min"),
])
def test_geo_and_range_validation(kw, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        ObjectiveConfig(**kw)
    assert ObjectiveConfig(geo_min=0.0).geo_min == 0.0  # no lower mask


def test_refused_at_load_in_one_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("objective: {is_mode: seq_tis}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    text = str(err.value)
    assert "\n" not in text and "objective: score_centering with is_mode 'seq_tis' is refused" in text
    assert load_config(str(path), ["objective.score_centering=false"]).objective.is_mode == "seq_tis"
