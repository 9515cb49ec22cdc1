"""The corrected policy-gradient objective: MIS/TIS weights, score centering, top-p replay.

Public entry point: ``policy_loss(hidden, lm_head, batch, config) -> (loss, metrics)``.
Registries (one small function per variant): ``IMPORTANCE_WEIGHTS``, ``SCORE_CENTERING``,
``ADVANTAGE_ESTIMATORS``, ``AGGREGATIONS``.
"""

from trainer_jax.objective.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from trainer_jax.objective.aggregation import AGGREGATIONS
from trainer_jax.objective.batch import TokenBatch
from trainer_jax.objective.config import KERNEL_IMPLS, ObjectiveConfig
from trainer_jax.objective.loss import TokenTerms, policy_loss, token_terms
from trainer_jax.objective.metrics import Metric, Metrics, reduce_metrics, sum_metrics
from trainer_jax.objective.registry import Registry
from trainer_jax.objective.weights import IMPORTANCE_WEIGHTS, SCORE_CENTERING

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "IMPORTANCE_WEIGHTS",
    "KERNEL_IMPLS",
    "SCORE_CENTERING",
    "Metric",
    "Metrics",
    "ObjectiveConfig",
    "Registry",
    "TokenBatch",
    "TokenTerms",
    "compute_advantages",
    "policy_loss",
    "reduce_metrics",
    "sum_metrics",
    "token_terms",
]
