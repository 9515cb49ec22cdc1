"""The objective's variant names, for the JAX-free schema (``config.learning``) and the runtime.

The registries in ``trainer_jax.objective`` hold the functions (and import JAX); the schema only
needs their names to validate a config. Both import this module, and the registries check at
import that they implement exactly these names, so the two cannot drift apart.
"""

from __future__ import annotations

#: ``objective.is_mode``: token-level (``none``, ``tis``, ``mis``) and sequence-level weights.
IS_MODES = ("none", "tis", "mis", "seq_tis", "seq_mis", "geo_mask")
#: The modes whose weight is shared by a sample's tokens (their metrics count masked samples and
#: they need in-range sequence ids).
SEQUENCE_MODES = frozenset({"seq_tis", "seq_mis", "geo_mask"})
#: Modes score centering cannot be written for with the per-token tail model, and why.
CENTERING_REFUSED: dict[str, str] = {
    "seq_tis": "min(R_s, c_max) caps the product over the whole sample, so the weight of an "
    "alternative token depends on the continuation it would have produced, which no record holds; "
    "the per-token head + rho tail model cannot centre it",
    "seq_mis": "the mask 1[c_min <= R_s <= c_max] acts on the product over the whole sample, so "
    "the weight of an alternative token depends on the continuation it would have produced, which "
    "no record holds; the per-token head + rho tail model cannot centre it",
}
#: The modes with a score-centering term (``SCORE_CENTERING``'s names).
CENTERED_MODES = tuple(m for m in IS_MODES if m not in CENTERING_REFUSED)
#: ``objective.aggregation``.
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "constant")

