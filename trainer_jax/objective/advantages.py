"""Advantage estimators over groups of G samples per prompt.

Each estimator maps rewards [P, G] (P prompts, G samples each) to advantages [P, G]; the trainer
broadcasts a sample's advantage to all of its policy tokens.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from trainer_jax.objective.registry import Registry

Array = jax.Array


class AdvantageFn(Protocol):
    def __call__(self, rewards: Array, eps: float) -> Array: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(rewards: Array, eps: float) -> Array:
    """GRPO: A = (r - mean_G r) / (std_G r + eps), population std (ddof = 0) over the group.

    A group whose rewards are all equal gets A = 0 (no signal), not a division by zero.
    """
    mean = rewards.mean(axis=-1, keepdims=True)
    std = rewards.std(axis=-1, keepdims=True)
    return (rewards - mean) / (std + eps)


@ADVANTAGE_ESTIMATORS.register("grpo_mean")
def grpo_mean(rewards: Array, eps: float) -> Array:
    """Mean-only GRPO (Dr. GRPO style): A = r - mean_G r (no std normalisation)."""
    return rewards - rewards.mean(axis=-1, keepdims=True)


def compute_advantages(rewards: Array, estimator: str = "grpo", *, eps: float = 1e-6) -> Array:
    """Advantages [P, G] from rewards [P, G] with the registered ``estimator``."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [P, G], got shape {rewards.shape}")
    return ADVANTAGE_ESTIMATORS.get(estimator)(rewards, eps)
