"""The corrected policy-gradient objective (docs/design.md section 4).

Per policy token t, with trainer logits z_t = h_t W / tau and log p_t(x) = z_{t,x} - lse_t:

  head H_t:    the kept set S_t with its exact b when truncation was active (any valid support
               id); otherwise the top-K of q with q's probabilities and the tail approximated by
               rho_t p, rho_t = (1 - sum_H b) / (1 - sum_H p)  (rho_t = 0 under truncation).
  replay:      with ``top_p_replay`` and truncation active, p is replaced by
               p-hat = p / sum_S p on S (log p-hat = z_x - logsumexp_S z); logits outside S get no
               gradient and the head is exact.
  ratio:       r_t = p_t(x_t) / b_t(x_t), stop-gradient; token weight w_t = w(r_t) for the token
               modes, a function of the sample's log R_s = sum_{u in T_s} log r_u for the
               sequence modes (``weights``; T_s = the sample's scored tokens, by ``seq_ids``).
  centering:   C_t = sum_{x in H} coef_t(x) log p_t(x), coef stop-gradient (``weights``).
  loss:        l_t = -A_t (w_t log p_t(x_t) - k_t C_t), aggregated over masked tokens; k_t = 0
               for the tokens of a sample a sequence mask dropped, else 1.

With a constant advantage and x_t ~ b_t, E[grad l_t] = 0 whenever the head covers b_t (the tests
in tests/objective enumerate the vocabulary to check this); without centering it is
-A E_b[w grad log p], which pulls p toward b (drift).

The only full-vocabulary quantity is lse (and the entropy diagnostic), from the fused kernel;
every other logit is gathered at the ids the batch names.

Robustness: padding ids (< 0 or >= V) are masked; a token is dropped from loss and metrics
(counted in ``dropped``) when its behaviour log-prob or advantage is not finite, its id is out of
range, or truncation was active but x_t is not in S_t (an inconsistent record), or (sequence
modes only) its sequence id is outside [0, N) and so names no sample. All such paths
use ``where`` on finite values so masked tokens have exactly zero, NaN-free gradients.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from trainer_jax.config.objective_names import SEQUENCE_MODES
from trainer_jax.kernels.linear_logsumexp.names import resolve_impl
from trainer_jax.objective.aggregation import AGGREGATIONS
from trainer_jax.objective.batch import TokenBatch
from trainer_jax.objective.config import ObjectiveConfig
from trainer_jax.objective.logits import default_block_size, lse_and_logits_at
from trainer_jax.objective.metrics import Metric, Metrics, sequence_metrics, token_metrics
from trainer_jax.objective.weights import IMPORTANCE_WEIGHTS, SCORE_CENTERING, Ratios
from trainer_jax.parallel import hooks

Array = jax.Array
sg = jax.lax.stop_gradient

# |log r| is clipped here before exp: keeps r, k3 and the MIS/TIS arithmetic finite in f32
# (e^30 ~ 1e13 is far outside any sensible [c_min, c_max], so no weight changes).
_LOG_RATIO_CLIP = 30.0


class TokenTerms(NamedTuple):
    """Per-token pieces of the objective ([N] each), for the loss, metrics and tests."""

    loss: Array  # l_t (0 where not ``valid``)
    valid: Array  # effective mask: loss_mask and a consistent behaviour record
    logp: Array  # log p_t(x_t) (log p-hat under replay); differentiable
    ratio: Array  # r_t, stop-gradient
    weight: Array  # w_t
    keep: Array  # k_t: 0 on the tokens of a sample dropped by a sequence mask, else 1
    centering: Array  # C_t (0 without score centering); differentiable through log p
    rho: Array  # tail rescaling rho_t
    truncated: Array  # truncation active (support given)
    metrics: dict[str, Array]  # per-token diagnostics


def _masked_logsumexp(x: Array, mask: Array) -> Array:
    """logsumexp over the last axis where ``mask``; -inf for rows with no entry.

    NaN-free gradients even for empty rows and masked entries (exp of -inf, never of garbage).
    """
    m = sg(jnp.max(jnp.where(mask, x, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    s = jnp.sum(jnp.exp(jnp.where(mask, x - m, -jnp.inf)), axis=-1)
    has = s > 0
    return jnp.where(has, jnp.log(jnp.where(has, s, 1.0)) + m[..., 0], -jnp.inf)


def token_terms(hidden: Array, lm_head: Array, batch: TokenBatch, config: ObjectiveConfig) -> TokenTerms:
    """Compute l_t and the diagnostics for every token (see the module docstring)."""
    batch.check_shapes()
    if hidden.ndim != 2 or lm_head.ndim != 2 or lm_head.shape[0] != hidden.shape[1]:
        raise ValueError(f"need hidden [N, D], lm_head [D, V]; got {hidden.shape}, {lm_head.shape}")
    if hidden.shape[0] != batch.num_tokens:
        raise ValueError(f"hidden has {hidden.shape[0]} rows, batch has {batch.num_tokens} tokens")
    n, d = hidden.shape
    v = lm_head.shape[1]
    k = batch.head_ids.shape[1]
    c_min, c_max = config.c_min, config.c_max
    f32 = jnp.float32

    # ---- trainer logits: lse from the kernel, everything else gathered at named ids ----------
    ids = jnp.concatenate([batch.token_ids[:, None], batch.head_ids, batch.support_ids], axis=1).astype(
        jnp.int32
    )
    in_vocab = (ids >= 0) & (ids < v)
    safe_ids = jnp.where(in_vocab, ids, 0)
    block = config.gather_block_size or default_block_size(n, d, ids.shape[1])
    # On a device mesh the vocabulary-parallel version (trainer_jax.parallel.vocab) takes over.
    lse_fn = hooks.override("lse_and_logits_at") or lse_and_logits_at
    lse, entropy, z = lse_fn(
        hidden, lm_head, safe_ids, batch.temperature, resolve_impl(config.impl), block, config.kernel_options
    )
    z_x, z_head, z_sup = z[:, 0], z[:, 1 : 1 + k], z[:, 1 + k :]

    sup_ok = in_vocab[:, 1 + k :]
    truncated = sup_ok.any(axis=1)
    head_ok = in_vocab[:, 1 : 1 + k] & ~truncated[:, None]  # the top-K head only when no S
    replay = truncated & config.top_p_replay

    # log-normaliser per token: lse over S (replay: p-hat) or over the vocabulary (p).
    norm = jnp.where(replay, _masked_logsumexp(z_sup, sup_ok), lse)
    logp_x = z_x - norm

    # ---- the head H_t: top-K entries when not truncated, support entries when truncated -----
    z_h = jnp.concatenate([z_head, z_sup], axis=1)
    logb_h = jnp.concatenate([batch.head_logprobs, batch.support_logprobs], axis=1).astype(f32)
    ok_h = jnp.concatenate([head_ok, sup_ok], axis=1) & ~jnp.isnan(logb_h)
    logb_h = jnp.minimum(logb_h, 0.0)
    logp_h = z_h - norm[:, None]  # differentiable (the centering gradient flows here)
    lp_h = sg(logp_h)
    p_h = jnp.where(ok_h, jnp.exp(jnp.minimum(lp_h, 0.0)), 0.0)
    b_h = jnp.where(ok_h, jnp.exp(logb_h), 0.0)  # b = 0 (log b = -inf) is a valid head entry
    r_h = jnp.exp(jnp.where(ok_h, jnp.clip(lp_h - logb_h, -_LOG_RATIO_CLIP, _LOG_RATIO_CLIP), 0.0))
    mass_b = b_h.sum(axis=1)

    # rho = (1 - sum_H b) / (1 - sum_H p). 1 - sum_H p via -expm1(logsumexp_H log p): exact in
    # f32 down to ~1e-7 instead of cancelling; floored at min_tail_mass (rounding dominates below
    # it). Empty head: sum_H = 0 and rho = 1 (b's tail ~ p). Truncation: b has no tail, rho = 0.
    tail_p = -jnp.expm1(jnp.minimum(_masked_logsumexp(lp_h, ok_h), 0.0))
    tail_b = jnp.maximum(1.0 - mass_b, 0.0)
    rho = jnp.where(truncated, 0.0, tail_b / jnp.maximum(tail_p, config.min_tail_mass))

    if config.score_centering:
        coef = SCORE_CENTERING.get(config.is_mode)(p_h, b_h, r_h, rho[:, None], c_min, c_max)
        coef = sg(jnp.where(ok_h, coef, 0.0))
        centering = jnp.sum(jnp.where(ok_h, coef * logp_h, 0.0), axis=1)
    else:
        centering = jnp.zeros((n,), f32)

    # ---- sampled token: ratio, weight, validity ------------------------------------------------
    logb_x = batch.behavior_logprob.astype(f32)
    x_in_support = jnp.any((batch.support_ids == batch.token_ids[:, None]) & sup_ok, axis=1)
    adv = batch.advantages.astype(f32)
    valid = (
        (batch.loss_mask > 0)
        & in_vocab[:, 0]
        & jnp.isfinite(logb_x)
        & jnp.isfinite(adv)
        & (x_in_support | ~truncated)
    )
    if config.is_mode in SEQUENCE_MODES:
        # A token whose sequence id names no sample cannot be given its sample's ratio.
        valid = valid & (batch.seq_ids >= 0) & (batch.seq_ids < n)
    lp_x = sg(logp_x)
    # Per-token clip at +-30 (r ~ 1e13) changes no token weight; sequence modes sum these log r
    # over the sample (``weights.Ratios``) and never exponentiate the uncapped sum.
    log_r = jnp.where(valid, jnp.clip(lp_x - logb_x, -_LOG_RATIO_CLIP, _LOG_RATIO_CLIP), 0.0)
    ratio = jnp.exp(log_r)
    weights = IMPORTANCE_WEIGHTS.get(config.is_mode)(Ratios(log_r, valid, batch.seq_ids), config)
    weight, keep = weights.weight, weights.keep
    adv = jnp.where(valid, adv, 0.0)
    loss = jnp.where(valid, -adv * (weight * logp_x - keep * centering), 0.0)

    # ---- diagnostics (stop-gradient) ----------------------------------------------------------
    kl_head = jnp.sum(jnp.where(ok_h & (b_h > 0), b_h * (logb_h - lp_h), 0.0), axis=1)
    kl_tail = jnp.where((tail_b > 0) & (rho > 0), tail_b * jnp.log(jnp.where(rho > 0, rho, 1.0)), 0)
    full_p_h = jnp.where(ok_h, jnp.exp(jnp.minimum(sg(z_h - lse[:, None]), 0.0)), 0.0)
    per_token = {
        "k1": jnp.where(valid, logb_x - lp_x, 0.0),
        "k3": ratio - 1.0 - log_r,
        "head_kl": kl_head + kl_tail,
        "out_of_range": ((ratio < c_min) | (ratio > c_max)).astype(f32),
        "entropy": sg(entropy).astype(f32),
        "head_mass_b": mass_b,
        "head_mass_p": full_p_h.sum(axis=1),
        "rho": rho,
        "is_weight": weight,
        # w^2 beside w: reduce_metrics turns the two into the effective sample size (sum w)^2 / sum w^2.
        "is_weight_sq": weight * weight,
        "masked_tokens": (weight == 0).astype(f32),
        "truncated": truncated.astype(f32),
        "token_loss": sg(loss),
    }
    if batch.versions is not None and batch.trainer_version is not None:
        behind = batch.trainer_version - batch.versions
        per_token["staleness"] = behind.astype(f32)
        # Shares of tokens 0, 1 and 2+ versions behind the trainer: with partial rollouts one
        # episode's tokens may fall in several (a reload mid-request, or between its turns).
        per_token["staleness/0"] = (behind <= 0).astype(f32)
        per_token["staleness/1"] = (behind == 1).astype(f32)
        per_token["staleness/2plus"] = (behind >= 2).astype(f32)
    return TokenTerms(
        loss=loss,
        valid=valid,
        logp=logp_x,
        ratio=ratio,
        weight=weight,
        keep=keep,
        centering=centering,
        rho=rho,
        truncated=truncated,
        metrics=per_token,
    )


def policy_loss(
    hidden: Array, lm_head: Array, batch: TokenBatch, config: ObjectiveConfig
) -> tuple[Array, Metrics]:
    """Corrected policy-gradient loss and its (sum, count) diagnostics.

    hidden [N, D]: final-norm hidden states of the policy tokens; lm_head [D, V]; batch: a
    ``TokenBatch``; config: an ``ObjectiveConfig`` (hashable, pass it as a static argument under
    jit). Returns (scalar f32 loss, metrics) where metrics maps names to ``Metric(sum, count)``:
    overall under ``name`` and per sampler group under ``group/name`` (when batch.group_ids is
    given), including ``dropped``: loss-mask tokens rejected for an inconsistent record.
    """
    terms = token_terms(hidden, lm_head, batch, config)
    mask = terms.valid.astype(jnp.float32)
    loss = AGGREGATIONS.get(config.aggregation)(terms.loss, mask, batch.seq_ids, config)
    metrics = token_metrics(jax.tree.map(sg, terms.metrics), mask, batch.group_ids, config.num_groups)
    # "dropped" counts over loss-mask tokens, not over the valid ones.
    policy = (batch.loss_mask > 0).astype(jnp.float32)
    dropped = policy * (1.0 - mask)
    metrics["dropped"] = Metric(dropped.sum(), policy.sum())
    metrics.update(
        sequence_metrics(sg(terms.weight), terms.valid, batch.seq_ids, batch.group_ids, config.num_groups)
    )
    if batch.group_ids is not None:
        onehot = (batch.group_ids[:, None] == jnp.arange(config.num_groups)[None, :]).astype(jnp.float32)
        metrics["group/dropped"] = Metric(onehot.T @ dropped, onehot.T @ policy)
    return loss.astype(jnp.float32), metrics
