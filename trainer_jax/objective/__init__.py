"""The corrected policy-gradient objective: token and sequence importance weights (MIS/TIS,
sequence TIS/MIS, geometric-mean masks), score centering, top-p replay.

Public entry point: ``policy_loss(hidden, lm_head, batch, config) -> (loss, metrics)``.
Registries (one small function per variant): ``IMPORTANCE_WEIGHTS``, ``SCORE_CENTERING``,
``ADVANTAGE_ESTIMATORS``, ``AGGREGATIONS``.
"""

from trainer_jax.config.objective_names import CENTERING_REFUSED, SEQUENCE_MODES
from trainer_jax.objective.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from trainer_jax.objective.aggregation import AGGREGATIONS
from trainer_jax.objective.batch import TokenBatch
from trainer_jax.objective.config import KERNEL_IMPLS, ObjectiveConfig
from trainer_jax.objective.loss import TokenTerms, policy_loss, token_terms
from trainer_jax.objective.metrics import Metric, Metrics, reduce_metrics, sum_metrics
from trainer_jax.objective.registry import Registry
from trainer_jax.objective.weights import (
    IMPORTANCE_WEIGHTS,
    SCORE_CENTERING,
    Ratios,
    TokenWeights,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "CENTERING_REFUSED",
    "IMPORTANCE_WEIGHTS",
    "KERNEL_IMPLS",
    "SCORE_CENTERING",
    "SEQUENCE_MODES",
    "Metric",
    "Metrics",
    "ObjectiveConfig",
    "Ratios",
    "Registry",
    "TokenBatch",
    "TokenTerms",
    "TokenWeights",
    "compute_advantages",
    "policy_loss",
    "reduce_metrics",
    "sum_metrics",
    "token_terms",
]
