"""Shared builders for the objective tests: random problems, enumeration over x ~ b, and a dense
full-logits oracle of docs/design.md section 4 (independent of the gathered implementation)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer_jax.objective import ObjectiveConfig, TokenBatch

sg = jax.lax.stop_gradient


def _pad(rows: list[np.ndarray], width: int, fill: float, dtype: Any) -> np.ndarray:
    out = np.full((len(rows), max(width, 1)), fill, dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def softmax_np(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def top_p_set(q: np.ndarray, top_p: float, cap: int) -> np.ndarray:
    """Smallest prefix of q sorted descending with mass >= top_p (at most ``cap`` ids)."""
    order = np.argsort(-q)
    n = int(np.searchsorted(np.cumsum(q[order]), top_p) + 1)
    return order[: min(n, cap, len(q))]


class Problem:
    """Per-position trainer inputs and behaviour distributions (float64 numpy)."""

    def __init__(self, rng: np.random.Generator, t: int, d: int, v: int, tau: float, noise: float) -> None:
        self.tau = tau
        self.hidden = rng.normal(size=(t, d)).astype(np.float32)
        self.lm_head = (rng.normal(size=(d, v)) * 2.0 / np.sqrt(d)).astype(np.float32)
        self.logits = self.hidden.astype(np.float64) @ self.lm_head.astype(np.float64) / tau
        self.p = softmax_np(self.logits)
        # The sampler's q: same model seen through a different "precision" (logit noise).
        self.q = softmax_np(self.logits + noise * rng.normal(size=self.logits.shape))


def make_rows(
    problem: Problem,
    b: list[np.ndarray],
    support: list[np.ndarray | None],
    head: list[np.ndarray],
    head_q: list[np.ndarray],
) -> tuple[np.ndarray, TokenBatch]:
    """Enumerate x ~ b_t exactly: one row per (t, x) with b_t(x) > 0 and advantage b_t(x).

    With ``aggregation="constant"`` (normaliser 1) the loss is sum_t E_{x~b_t}[l_t(x)] for a
    constant advantage A = 1, so its gradient is the exact expected gradient.
    Returns (row -> position index, batch).
    """
    pos, tok, logb, adv, sup_rows, supl_rows, head_rows, headl_rows = ([] for _ in range(8))
    for t, bt in enumerate(b):
        for x in np.nonzero(bt > 0)[0]:
            pos.append(t)
            tok.append(x)
            logb.append(np.log(bt[x]))
            adv.append(bt[x])
            s = support[t]
            sup_rows.append(np.array([], np.int64) if s is None else s)
            supl_rows.append(np.array([]) if s is None else np.log(bt[s]))
            head_rows.append(head[t])
            headl_rows.append(np.log(head_q[t]))
    s_w = max(len(r) for r in sup_rows)
    k_w = max(len(r) for r in head_rows)
    n = len(tok)
    batch = TokenBatch.create(
        token_ids=np.array(tok),
        behavior_logprob=np.array(logb),
        head_ids=_pad(head_rows, k_w, -1, np.int32),
        head_logprobs=_pad(headl_rows, k_w, -np.inf, np.float32),
        support_ids=_pad(sup_rows, s_w, -1, np.int32),
        support_logprobs=_pad(supl_rows, s_w, -np.inf, np.float32),
        advantages=np.array(adv),
        loss_mask=np.ones(n),
        seq_ids=np.arange(n),
        temperature=problem.tau,
    )
    return np.array(pos), batch


def random_batch(
    rng: np.random.Generator,
    problem: Problem,
    k: int,
    s_cap: int,
    trunc_frac: float = 0.5,
    top_p: float = 0.8,
    num_groups: int = 3,
) -> TokenBatch:
    """One sampled token per position; truncation active on ~``trunc_frac`` of the positions."""
    n, v = problem.p.shape
    tok, logb, heads, headl, sups, supl = [], [], [], [], [], []
    for t in range(n):
        q = problem.q[t]
        h = np.argsort(-q)[:k]
        heads.append(h)
        headl.append(np.log(q[h]))
        if rng.uniform() < trunc_frac:
            s = top_p_set(q, top_p, s_cap)
            bt = np.zeros(v)
            bt[s] = q[s] / q[s].sum()
            sups.append(s)
            supl.append(np.log(bt[s]))
        else:
            bt = q
            sups.append(np.array([], np.int64))
            supl.append(np.array([]))
        x = rng.choice(v, p=bt / bt.sum())
        tok.append(x)
        logb.append(np.log(bt[x]))
    mask = (rng.uniform(size=n) > 0.15).astype(np.float32)
    return TokenBatch.create(
        token_ids=np.array(tok),
        behavior_logprob=np.array(logb),
        head_ids=_pad(heads, k, -1, np.int32),
        head_logprobs=_pad(headl, k, -np.inf, np.float32),
        support_ids=_pad(sups, s_cap, -1, np.int32),
        support_logprobs=_pad(supl, s_cap, -np.inf, np.float32),
        advantages=rng.normal(size=n),
        loss_mask=mask,
        seq_ids=np.arange(n) // 4,
        temperature=problem.tau,
        group_ids=rng.integers(0, num_groups, size=n),
    )


def dense_oracle_loss(
    hidden: jax.Array, lm_head: jax.Array, batch: TokenBatch, cfg: ObjectiveConfig
) -> jax.Array:
    """Section 4 with full [N, V] logits and dense head masks; token-mean aggregation."""
    n = hidden.shape[0]
    v = lm_head.shape[1]
    z = jnp.dot(hidden, lm_head, precision="highest") / batch.temperature
    rows = jnp.arange(n)[:, None]

    def scatter(ids: jax.Array, vals: jax.Array) -> tuple[jax.Array, jax.Array]:
        ok = ids >= 0
        m = jnp.zeros((n, v), bool).at[rows, jnp.where(ok, ids, 0)].max(ok)
        x = jnp.zeros((n, v)).at[rows, jnp.where(ok, ids, 0)].add(jnp.where(ok, vals, 0.0))
        return m, x

    s_mask, s_b = scatter(batch.support_ids, jnp.exp(batch.support_logprobs))
    h_mask, h_b = scatter(batch.head_ids, jnp.exp(batch.head_logprobs))
    trunc = s_mask.any(1)
    replay = trunc & cfg.top_p_replay
    lse_s = jax.nn.logsumexp(jnp.where(s_mask, z, -1e30), axis=1)
    logp = jnp.where(replay[:, None], z - lse_s[:, None], jax.nn.log_softmax(z, axis=1))
    hm = jnp.where(trunc[:, None], s_mask, h_mask)
    bv = jnp.where(trunc[:, None], s_b, h_b)
    p = jnp.exp(sg(logp))
    big_p = jnp.sum(jnp.where(hm, p, 0.0), 1)
    big_b = jnp.sum(bv, 1)
    rho = jnp.where(trunc, 0.0, (1 - big_b) / jnp.maximum(1 - big_p, cfg.min_tail_mass))[:, None]
    c_lo, c_hi = cfg.c_min, cfg.c_max
    if cfg.is_mode == "none":
        coef = bv - rho * p
    elif cfg.is_mode == "tis":
        coef = jnp.minimum(p, c_hi * bv) - jnp.minimum(1.0, c_hi * rho) * p
    else:
        inside = (p >= c_lo * bv) & (p <= c_hi * bv)
        alpha = (rho > 0) & (1 / jnp.where(rho > 0, rho, 1) >= c_lo) & (1 / rho <= c_hi)
        coef = jnp.where(inside, p, 0.0) - jnp.where(alpha, p, 0.0)
    cen = jnp.sum(jnp.where(hm, sg(coef) * logp, 0.0), 1) if cfg.score_centering else 0.0
    logp_x = jnp.take_along_axis(logp, batch.token_ids[:, None], 1)[:, 0]
    r = jnp.exp(sg(logp_x) - batch.behavior_logprob)
    w = {
        "none": jnp.ones_like(r),
        "tis": jnp.minimum(r, c_hi),
        "mis": jnp.where((r >= c_lo) & (r <= c_hi), r, 0.0),
    }[cfg.is_mode]
    m = batch.loss_mask
    ell = jnp.where(m > 0, -batch.advantages * (w * logp_x - cen), 0.0)
    return jnp.sum(ell) / jnp.maximum(jnp.sum(m), 1.0)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def helpers() -> dict[str, Callable[..., Any]]:
    return {
        "Problem": Problem,
        "make_rows": make_rows,
        "random_batch": random_batch,
        "dense_oracle_loss": dense_oracle_loss,
        "top_p_set": top_p_set,
        "softmax_np": softmax_np,
    }
