"""The learner: one optax step of the corrected objective on a packed batch.

The model runs on the packed rows; the final-norm hidden state before each policy token and the LM
head go to ``policy_loss``, which never materialises ``[tokens, vocab]`` logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from trainer_jax.batching import PackedInputs
from trainer_jax.config import OptimizerConfig
from trainer_jax.models import Qwen3
from trainer_jax.objective import Metrics, ObjectiveConfig, TokenBatch, policy_loss


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    warmup = optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1))
    main = (optax.constant_schedule(cfg.learning_rate) if cfg.schedule == "constant"
            else optax.cosine_decay_schedule(cfg.learning_rate, cfg.decay_steps))
    schedule = optax.join_schedules([warmup, main], [cfg.warmup_steps]) if cfg.warmup_steps else main
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


def policy_hidden(model: Qwen3, inputs: PackedInputs) -> jax.Array:
    """Final-norm hidden states ``[N, D]`` that predict each policy token."""
    hidden = model.hidden_states(inputs.input_ids, positions=inputs.positions,
                                 segment_ids=inputs.segment_ids)
    return hidden[inputs.token_rows, inputs.token_cols]


def loss_and_metrics(model: Qwen3, inputs: PackedInputs, batch: TokenBatch,
                     objective: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    return policy_loss(policy_hidden(model, inputs), model.lm_head_weight(), batch, objective)


@dataclasses.dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    metrics: Metrics


@nnx.jit(static_argnames=("objective",))
def _train_step(model, optimizer, inputs, batch, objective):
    def loss_fn(m):
        return loss_and_metrics(m, inputs, batch, objective)

    (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, optax.tree.norm(grads), metrics


class Learner:
    """Holds the policy and its optimizer state; ``step`` applies one update."""

    def __init__(self, model: Qwen3, optimizer: OptimizerConfig, objective: ObjectiveConfig):
        self.model = model
        self.objective = objective
        self.optimizer = nnx.Optimizer(model, make_optimizer(optimizer), wrt=nnx.Param)

    @property
    def step_count(self) -> int:
        return int(self.optimizer.step.get_value())

    def step(self, inputs: PackedInputs, batch: TokenBatch) -> StepResult:
        loss, grad_norm, metrics = _train_step(self.model, self.optimizer, inputs, batch, self.objective)
        return StepResult(float(loss), float(grad_norm), metrics)

    def evaluate(self, inputs: PackedInputs, batch: TokenBatch) -> tuple[float, Metrics]:
        loss, metrics = nnx.jit(loss_and_metrics, static_argnames=("objective",))(
            self.model, inputs, batch, objective=self.objective)
        return float(loss), metrics


def sft_loss(model: Qwen3, inputs: PackedInputs, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked next-token cross-entropy for the warm start (full logits: SFT runs on tiny models)."""
    hidden = policy_hidden(model, inputs)
    logits = jnp.einsum("nd,dv->nv", hidden, model.lm_head_weight().astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)
