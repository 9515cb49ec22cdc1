"""Token importance weights and the matching score-centering coefficients (docs/design.md section 4).

Notation per policy token t: p = trainer distribution (or p-hat under top-p replay), b = behaviour
distribution actually sampled from, r = p/b (always stop-gradient), H = head of b (the kept top-p
set S when truncation was active, else the top-K of q), rho = (1 - sum_H b) / (1 - sum_H p) the
tail rescaling (rho = 0 when the head covers b exactly).

Score centering subtracts C = sum_{x in H} coef(x) log p(x) (coef stop-gradient) from the sampled
term w(x_t) log p(x_t). Its gradient is the exact expectation E_{x~b}[w(x) grad log p(x)] under the
model "b = rho p on the tail":

    E_b[w grad log p] = sum_H b w(p/b) grad log p + sum_tail rho p w(1/rho) grad log p
                      = sum_H (b w(p/b) - rho w(1/rho) p) grad log p      (sum_v p grad log p = 0)

so coef(x) = b(x) w(r(x)) - rho w(1/rho) p(x) for every weight mode. Each mode registers the
closed form of that identity below (``tests/objective`` checks it against the generic formula).
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from trainer_jax.objective.registry import Registry

Array = jax.Array


class WeightFn(Protocol):
    def __call__(self, r: Array, c_min: float, c_max: float) -> Array: ...


class CenteringFn(Protocol):
    def __call__(self, p: Array, b: Array, r: Array, rho: Array, c_min: float, c_max: float) -> Array: ...


IMPORTANCE_WEIGHTS: Registry[WeightFn] = Registry("importance-weight mode")
SCORE_CENTERING: Registry[CenteringFn] = Registry("score-centering variant")


def _in_range(r: Array, c_min: float, c_max: float) -> Array:
    return (r >= c_min) & (r <= c_max)


@IMPORTANCE_WEIGHTS.register("none")
def weight_none(r: Array, c_min: float, c_max: float) -> Array:
    """w = 1 (plain on-policy REINFORCE; ignores the mismatch)."""
    return jnp.ones_like(r)


@IMPORTANCE_WEIGHTS.register("tis")
def weight_tis(r: Array, c_min: float, c_max: float) -> Array:
    """Truncated IS: w = min(r, c_max)."""
    return jnp.minimum(r, c_max)


@IMPORTANCE_WEIGHTS.register("mis")
def weight_mis(r: Array, c_min: float, c_max: float) -> Array:
    """Masked IS: w = r * 1[c_min <= r <= c_max] (tokens outside the range get weight 0)."""
    # where, not multiply: r may be huge for masked-out tokens and 0 * inf would be NaN.
    return jnp.where(_in_range(r, c_min, c_max), r, 0.0)


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
