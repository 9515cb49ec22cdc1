"""ObjectiveConfig: the validated, hashable (so usable as a jit static argument) loss config."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainer_jax.kernels.linear_logsumexp.names import IMPL_NAMES, ImplName
from trainer_jax.objective.aggregation import AGGREGATIONS
from trainer_jax.objective.weights import IMPORTANCE_WEIGHTS, SCORE_CENTERING

# Defined once, in the kernel package; re-exported under the objective's established name.
KERNEL_IMPLS = IMPL_NAMES


class ObjectiveConfig(BaseModel):
    """Which corrections the policy-gradient objective applies (DESIGN.md section 4).

    is_mode: token importance weight, a name in ``IMPORTANCE_WEIGHTS`` (none | tis | mis).
    score_centering: subtract the exact head + rho-tail expectation C_t (see ``weights``).
    top_p_replay: on tokens sampled with truncation, use p-hat = p / sum_S p on the kept set S.
    c_min, c_max: the MIS range / TIS cap on r = p / b.
    aggregation: a name in ``AGGREGATIONS``; ``constant_normalizer`` is used by "constant".
    impl: linear-log-sum-exp kernel implementation, a name in ``KERNEL_IMPLS``.
    kernel_options: (name, value) pairs passed to the kernel, e.g. (("block_v", 2048),); the
        kernel rejects options its ``impl`` does not take.
    num_groups: sampler groups for per-group metrics (group ids outside [0, num_groups) are
        counted only in the overall metrics).
    min_tail_mass: floor on the trainer tail mass 1 - sum_H p in the denominator of rho; below it
        the f32 value of 1 - sum_H p is dominated by rounding (~1e-6) and rho would blow up.
    gather_block_size: tokens per block of the head-logit gather (None: sized to ~32 MiB).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    is_mode: str = "mis"
    score_centering: bool = True
    top_p_replay: bool = True
    c_min: float = Field(default=0.2, ge=0.0)
    c_max: float = Field(default=5.0, gt=0.0)
    aggregation: str = "token_mean"
    constant_normalizer: float = Field(default=1.0, gt=0.0)
    impl: ImplName = "xla"
    kernel_options: tuple[tuple[str, int | float | bool | str], ...] = ()
    num_groups: int = Field(default=1, ge=1)
    min_tail_mass: float = Field(default=1e-4, gt=0.0, lt=1.0)
    gather_block_size: int | None = Field(default=None, ge=1)

    @field_validator("is_mode")
    @classmethod
    def _known_mode(cls, v: str) -> str:
        if v not in IMPORTANCE_WEIGHTS:
            raise ValueError(f"is_mode must be one of {IMPORTANCE_WEIGHTS.names()}, got {v!r}")
        if v not in SCORE_CENTERING:
            raise ValueError(f"is_mode {v!r} has no registered score-centering variant")
        return v

    @field_validator("aggregation")
    @classmethod
    def _known_aggregation(cls, v: str) -> str:
        if v not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS.names()}, got {v!r}")
        return v

    @field_validator("kernel_options")
    @classmethod
    def _unique_options(
        cls, v: tuple[tuple[str, int | float | bool | str], ...]
    ) -> tuple[tuple[str, int | float | bool | str], ...]:
        names = [k for k, _ in v]
        if len(set(names)) != len(names):
            raise ValueError(f"kernel_options has repeated names: {names}")
        return v

    @field_validator("c_min", "c_max", "constant_normalizer")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"must be finite, got {v}")
        return v

    @model_validator(mode="after")
    def _range(self) -> ObjectiveConfig:
        if not self.c_min < self.c_max:
            raise ValueError(f"need c_min < c_max, got c_min={self.c_min}, c_max={self.c_max}")
        if self.is_mode == "mis" and not self.c_min <= 1.0 <= self.c_max:
            # r = 1 (on-policy) must keep its weight, otherwise MIS drops exact samples.
            raise ValueError(f"mis needs c_min <= 1 <= c_max, got [{self.c_min}, {self.c_max}]")
        return self
