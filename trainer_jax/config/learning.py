"""The learner's sections: the policy model, the objective, the optimizer, the warm start.

Importable without JAX: the objective's names (importance-weight modes, aggregations, kernel
implementations) are checked against their registries only when a config is validated, by a
lazy import, so the registries stay the one definition of each name while the rollout service
and the config tools load no JAX.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainer_jax.config.base import Strict as _Strict
from trainer_jax.config.base import one_of
from trainer_jax.config.objective_names import AGGREGATIONS, CENTERING_REFUSED, IS_MODES


class ModelConfig(_Strict):
    """The policy: an HF directory to start from, or a tiny random Qwen3 for local runs."""

    hf_dir: str | None = None
    vocab: Literal["char"] = "char"
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    head_dim: int = Field(16, gt=0)
    tie_word_embeddings: bool = True
    num_experts: int = Field(0, ge=0)
    num_experts_per_tok: int = Field(0, ge=0)
    moe_intermediate_size: int = Field(0, ge=0)
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"  # the trainer's compute dtype (params stay fp32)
    # trainer_jax.models.attention.IMPLS, or auto: a fused kernel where scripts/device_check.sh
    # passed it on this device kind and jax minor (trainer_jax/kernels/checked.py), else blocked
    attention: str = "auto"

    @field_validator("attention")
    @classmethod
    def _known_attention(cls, v: str) -> str:
        from trainer_jax.models.attention import IMPLS

        return one_of(v, ("auto", *IMPLS), "attention implementation")


class OptimizerConfig(_Strict):
    """AdamW with global-norm clipping and linear warmup into a constant or cosine schedule."""

    learning_rate: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: str = Field("constant", pattern="^(constant|cosine)$")
    decay_steps: int = Field(1000, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.99, ge=0, lt=1)
    clip_norm: float = Field(1.0, gt=0)


class SFTConfig(_Strict):
    """The supervised warm start on environment demonstrations (``trainer_jax.sft``)."""

    steps: int = Field(300, ge=0)
    sequences_per_step: int = Field(32, gt=0)
    learning_rate: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    rows: int = Field(8, gt=0)
    row_len: int = Field(256, gt=0)
    max_tokens: int = Field(1024, gt=0)


class ObjectiveConfig(BaseModel):
    """Which corrections the policy-gradient objective applies (docs/design.md section 4).

    is_mode: importance weight, a name in ``IMPORTANCE_WEIGHTS``: per token none | tis | mis, per
        sample seq_tis | seq_mis | geo_mask (``trainer_jax.objective.weights``).
    score_centering: subtract the exact head + rho-tail expectation C_t (see ``weights``); refused
        with seq_tis / seq_mis (``CENTERING_REFUSED`` says why).
    top_p_replay: on tokens sampled with truncation, use p-hat = p / sum_S p on the kept set S.
    c_min, c_max: the MIS range / TIS cap on r = p / b (on R_s for seq_tis / seq_mis).
    geo_min, geo_max: geo_mask keeps a sample when exp(mean_t log r_t) is in [geo_min, geo_max]
        (defaults 0.8 and 1.25, symmetric in log: a sample whose average token ratio is off by
        more than 25 %; the demo's fp4 groups average k3 ~0.1-0.2, so this drops their worst
        samples, not the pool).
    aggregation: a name in ``AGGREGATIONS``; ``constant_normalizer`` is used by "constant".
    impl: linear-log-sum-exp kernel implementation (reference | xla | pallas), or ``auto``: the
        ``pallas`` where the device check passed it here (``kernels/checked.py``), else ``xla``.
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
    geo_min: float = Field(default=0.8, ge=0.0)
    geo_max: float = Field(default=1.25, gt=0.0)
    aggregation: str = "token_mean"
    constant_normalizer: float = Field(default=1.0, gt=0.0)
    impl: str = "auto"
    kernel_options: tuple[tuple[str, int | float | bool | str], ...] = ()
    num_groups: int = Field(default=1, ge=1)
    min_tail_mass: float = Field(default=1e-4, gt=0.0, lt=1.0)
    gather_block_size: int | None = Field(default=None, ge=1)

    @field_validator("is_mode")
    @classmethod
    def _known_mode(cls, v: str) -> str:
        return one_of(v, IS_MODES, "importance-weight mode")

    @field_validator("aggregation")
    @classmethod
    def _known_aggregation(cls, v: str) -> str:
        return one_of(v, AGGREGATIONS, "aggregation")

    @field_validator("impl")
    @classmethod
    def _known_impl(cls, v: str) -> str:
        from trainer_jax.kernels.linear_logsumexp.names import IMPL_CHOICES

        return one_of(v, IMPL_CHOICES, "kernel implementation")

    @field_validator("kernel_options")
    @classmethod
    def _unique_options(
        cls, v: tuple[tuple[str, int | float | bool | str], ...]
    ) -> tuple[tuple[str, int | float | bool | str], ...]:
        names = [k for k, _ in v]
        if len(set(names)) != len(names):
            raise ValueError(f"kernel_options has repeated names: {names}")
        return v

    @field_validator("c_min", "c_max", "geo_min", "geo_max", "constant_normalizer")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"must be finite, got {v}")
        return v

    @model_validator(mode="after")
    def _range(self) -> ObjectiveConfig:
        if not self.c_min < self.c_max:
            raise ValueError(f"need c_min < c_max, got c_min={self.c_min}, c_max={self.c_max}")
        if self.is_mode in ("mis", "seq_mis", "geo_mask") and not self.c_min <= 1.0 <= self.c_max:
            # r = 1 (on-policy) must keep its weight, otherwise MIS drops exact samples.
            raise ValueError(f"{self.is_mode} needs c_min <= 1 <= c_max, got [{self.c_min}, {self.c_max}]")
        if not self.geo_min < 1.0 < self.geo_max:
            # G_s = 1 (an on-policy sample) must be kept by geo_mask.
            raise ValueError(f"need geo_min < 1 < geo_max, got [{self.geo_min}, {self.geo_max}]")
        if self.score_centering:
            if self.is_mode in CENTERING_REFUSED:
                raise ValueError(
                    f"score_centering with is_mode {self.is_mode!r} is refused: "
                    f"{CENTERING_REFUSED[self.is_mode]}; set objective.score_centering=false "
                    "(or use geo_mask, which composes with it)"
                )
        return self
