"""Importance weights (token and sequence level) and the matching score-centering coefficients
(docs/design.md section 4).

Notation per policy token t: p = trainer distribution (or p-hat under top-p replay), b = behaviour
distribution actually sampled from, r = p/b (always stop-gradient), H = head of b (the kept top-p
set S when truncation was active, else the top-K of q), rho = (1 - sum_H b) / (1 - sum_H p) the
tail rescaling (rho = 0 when the head covers b exactly). Per sample s with scored policy tokens
T_s (``Ratios.valid``: padding, environment tokens and dropped records never enter):
log R_s = sum_{t in T_s} log r_t, the sequence ratio R_s = prod r_t, computed in log space
because it under- or overflows float32 after a few dozen tokens.

Score centering subtracts C = sum_{x in H} coef(x) log p(x) (coef stop-gradient) from the sampled
term w(x_t) log p(x_t). Its gradient is the exact expectation E_{x~b}[w(x) grad log p(x)] under the
model "b = rho p on the tail":

    E_b[w grad log p] = sum_H b w(p/b) grad log p + sum_tail rho p w(1/rho) grad log p
                      = sum_H (b w(p/b) - rho w(1/rho) p) grad log p      (sum_v p grad log p = 0)

so coef(x) = b(x) w(r(x)) - rho w(1/rho) p(x) whenever the weight of an alternative x at t is a
function of r(x) alone. Each token-level mode registers the closed form of that identity below
(``tests/objective`` checks it against the generic formula). The sequence modes that break it are
listed in ``CENTERING_REFUSED`` with the reason; the config refuses them with score centering.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from trainer_jax.config.base import check_registry
from trainer_jax.config.objective_names import CENTERED_MODES, IS_MODES
from trainer_jax.objective.registry import Registry

if TYPE_CHECKING:
    from trainer_jax.config.learning import ObjectiveConfig

Array = jax.Array


class Ratios(NamedTuple):
    """What a weight mode reads: per-token log ratios and the sample each token belongs to ([N]).

    log_r: log r_t, stop-gradient and already 0 where not ``valid``; valid: tokens scored by the
    loss (only these enter sequence sums); seq_ids: batch-local sample id in [0, N) (a packed row
    holds several samples; the id, not the row, keeps them apart).
    """

    log_r: Array
    valid: Array
    seq_ids: Array

    def per_sample(self, x: Array) -> Array:
        """sum_{u in T_s} x_u for the sample s of every token t ([N]; gathered back per token)."""
        n = x.shape[0]
        total = jax.ops.segment_sum(jnp.where(self.valid, x, 0.0), self.seq_ids, num_segments=n)
        return total[jnp.clip(self.seq_ids, 0, n - 1)]


class TokenWeights(NamedTuple):
    """A mode's weights: ``weight`` w_t multiplies log p_t(x_t); ``keep`` (0/1) multiplies the
    centering term C_t too (a whole sample dropped by a sequence mask loses both)."""

    weight: Array
    keep: Array


class WeightFn(Protocol):
    def __call__(self, ratios: Ratios, config: ObjectiveConfig) -> TokenWeights: ...


class CenteringFn(Protocol):
    def __call__(self, p: Array, b: Array, r: Array, rho: Array, c_min: float, c_max: float) -> Array: ...


IMPORTANCE_WEIGHTS: Registry[WeightFn] = Registry("importance-weight mode")
SCORE_CENTERING: Registry[CenteringFn] = Registry("score-centering variant")

# CENTERING_REFUSED (config.objective_names) lists the modes whose token weight depends on the other
# tokens of the sample: E_{x~b}[w(x) grad log p(x)] at t needs the weight of every alternative x_t,
# i.e. R_s with x_t swapped in *and the continuation it would have produced*, which the record
# never holds; the per-token head + rho tail model has nothing to write it with. (Plain untruncated
# IS needs no centering at all, E_b[r grad log p] = E_p[grad log p] = 0; it is the cap / mask
# applied to the product that breaks.)


def _in_range(r: Array, c_min: float, c_max: float) -> Array:
    return (r >= c_min) & (r <= c_max)


def _log(c: float) -> float:
    return math.log(c) if c > 0 else -math.inf


def _token_only(w: Array) -> TokenWeights:
    return TokenWeights(w, jnp.ones_like(w))


def tis(r: Array, c_max: float) -> Array:
    """min(r, c_max) (the token-level TIS weight as a plain function of r)."""
    return jnp.minimum(r, c_max)


def mis(r: Array, c_min: float, c_max: float) -> Array:
    """r 1[c_min <= r <= c_max] (the token-level MIS weight as a plain function of r)."""
    # where, not multiply: r may be huge for masked-out tokens and 0 * inf would be NaN.
    return jnp.where(_in_range(r, c_min, c_max), r, 0.0)


@IMPORTANCE_WEIGHTS.register("none")
def weight_none(ratios: Ratios, config: ObjectiveConfig) -> TokenWeights:
    """w = 1 (plain on-policy REINFORCE; ignores the mismatch)."""
    return _token_only(jnp.ones_like(ratios.log_r))


@IMPORTANCE_WEIGHTS.register("tis")
def weight_tis(ratios: Ratios, config: ObjectiveConfig) -> TokenWeights:
    """Truncated IS: w_t = min(r_t, c_max)."""
    return _token_only(tis(jnp.exp(ratios.log_r), config.c_max))


@IMPORTANCE_WEIGHTS.register("mis")
def weight_mis(ratios: Ratios, config: ObjectiveConfig) -> TokenWeights:
    """Masked IS: w_t = r_t 1[c_min <= r_t <= c_max] (tokens outside the range get weight 0)."""
    return _token_only(mis(jnp.exp(ratios.log_r), config.c_min, config.c_max))


@IMPORTANCE_WEIGHTS.register("seq_tis")
def weight_seq_tis(ratios: Ratios, config: ObjectiveConfig) -> TokenWeights:
    """Sequence TIS: every token of sample s gets w = min(R_s, c_max) = exp(min(log R_s, log c_max)).

    The cap is applied in log space, so a long sample's R_s never overflows; a tiny R_s underflows
    to weight 0, which is its value in float32 anyway. Centering refused (``CENTERING_REFUSED``).
    """
    log_big_r = ratios.per_sample(ratios.log_r)
    return _token_only(jnp.exp(jnp.minimum(log_big_r, _log(config.c_max))))


@IMPORTANCE_WEIGHTS.register("seq_mis")
def weight_seq_mis(ratios: Ratios, config: ObjectiveConfig) -> TokenWeights:
    """Sequence MIS: every token of sample s gets w = R_s 1[c_min <= R_s <= c_max].

    The range test is on log R_s (log c_min = -inf for c_min = 0), and exp is taken only of a
    value already known to be <= log c_max, so no inf is ever formed. Centering refused.
    """
    log_big_r = ratios.per_sample(ratios.log_r)
    inside = (log_big_r >= _log(config.c_min)) & (log_big_r <= _log(config.c_max))
    w = jnp.where(inside, jnp.exp(jnp.minimum(log_big_r, _log(config.c_max))), 0.0)
    return TokenWeights(w, inside.astype(w.dtype))


@IMPORTANCE_WEIGHTS.register("geo_mask")
def weight_geo_mask(ratios: Ratios, config: ObjectiveConfig) -> TokenWeights:
    """Geometric-mean sequence mask: G_s = exp(log R_s / |T_s|); the whole sample gets weight 0
    (and no centering) when G_s is outside [geo_min, geo_max], else every token t gets the MIS
    weight r_t 1[c_min <= r_t <= c_max].

    Centering composes: the token weights are ``mis``'s, a function of r_t alone, so the head +
    rho tail model gives their exact expectation (``centering_mis``), and the mask M_s in {0, 1}
    multiplies the whole centred term l_t = -A_s M_s (w_t log p_t - C_t). M_s is a per-sample
    factor, as the advantage A_s already is (both depend on every token of the sample); SC treats
    the advantage as a constant multiplier and M_s is handled the same way.
    """
    log_big_r = ratios.per_sample(ratios.log_r)
    count = ratios.per_sample(jnp.ones_like(ratios.log_r))
    mean_log_r = log_big_r / jnp.maximum(count, 1.0)
    keep = (mean_log_r >= _log(config.geo_min)) & (mean_log_r <= _log(config.geo_max))
    w = jnp.where(keep, mis(jnp.exp(ratios.log_r), config.c_min, config.c_max), 0.0)
    return TokenWeights(w, keep.astype(w.dtype))


@SCORE_CENTERING.register("none")
def centering_none(p: Array, b: Array, r: Array, rho: Array, c_min: float, c_max: float) -> Array:
    """coef = b - rho p  (w = 1: b w(p/b) = b, rho w(1/rho) = rho)."""
    return b - rho * p


@SCORE_CENTERING.register("tis")
def centering_tis(p: Array, b: Array, r: Array, rho: Array, c_min: float, c_max: float) -> Array:
    """coef = min(p, c_max b) - min(1, c_max rho) p  (b min(p/b, c) = min(p, c b))."""
    return jnp.minimum(p, c_max * b) - jnp.minimum(1.0, c_max * rho) * p


@SCORE_CENTERING.register("mis")
def centering_mis(p: Array, b: Array, r: Array, rho: Array, c_min: float, c_max: float) -> Array:
    """coef = p 1[c_min <= p/b <= c_max] - alpha p,  alpha = 1[c_min <= 1/rho <= c_max].

    The head indicator uses the same ratio r = p/b as the token weight so both sides of the
    centering agree bit for bit. alpha is written without dividing by rho: rho = 0 means the
    behaviour tail carries no mass (truncation, replay), no tail token can be sampled, 1/rho = inf
    is outside the range and alpha = 0 -- exactly the limit rho * w(1/rho) -> 0.
    """
    alpha = (rho > 0) & (c_min * rho <= 1.0) & (c_max * rho >= 1.0)
    return jnp.where(_in_range(r, c_min, c_max), p, 0.0) - alpha.astype(p.dtype) * p


@SCORE_CENTERING.register("geo_mask")
def centering_geo_mask(p: Array, b: Array, r: Array, rho: Array, c_min: float, c_max: float) -> Array:
    """coef = MIS's (the kept samples' token weights are MIS's; the mask multiplies C_t via keep)."""
    return centering_mis(p, b, r, rho, c_min, c_max)


check_registry(IMPORTANCE_WEIGHTS.kind, IMPORTANCE_WEIGHTS.names(), IS_MODES)
check_registry(SCORE_CENTERING.kind, SCORE_CENTERING.names(), CENTERED_MODES)
