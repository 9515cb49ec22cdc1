"""Supervised warm start: train the policy on environment demonstrations before RL.

A tiny random model never succeeds, so RL has no signal. Each environment can produce a correct
episode (``Environment.demonstration``: tokens and the mask of policy tokens; tool episodes run
their commands in the real sandbox); a few hundred steps of masked cross-entropy on those give a
policy that sometimes succeeds, which is where the RL phase starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from trainer_jax.batching import pack_sequences
from trainer_jax.config import SFTConfig
from trainer_jax.learner import sft_loss, sharded_optimizer
from trainer_jax.models import Qwen3
from trainer_jax.parallel import dispatch
from trainer_jax.parallel.context import ParallelContext
from trainer_jax.parallel.mesh import make_mesh
from trainer_jax.parallel.rules import ShardingRules
from trainer_jax.parallel.sharding import shard_batch


def warm_start(model: Qwen3, envs: Sequence, cfg: SFTConfig, rng: np.random.Generator,
               on_step: Callable[[int, float], None] | None = None,
               share: Callable[[Any], Any] = lambda batch: batch,
               context: ParallelContext | None = None) -> list[float]:
    """Train ``model`` in place on demonstrations drawn evenly from ``envs``; return the losses.

    ``context``: the mesh and rules the model lives on (the learner's; default: one device). The
    optimizer state is created sharded like the parameters, each batch is split over the batch
    axes, and the step is traced under the context, so the warm start runs the same sharded
    model as the RL steps (attention and MoE maps included). ``share``: with several processes,
    makes every process train on process 0's batch (``Lockstep.share``), whatever its own draw gave.
    """
    if context is None:
        context = ParallelContext(make_mesh(devices=jax.devices()[:1]),
                                  ShardingRules.for_model(model.config))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1),
                                                  max(cfg.steps, cfg.warmup_steps + 1))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    optimizer = sharded_optimizer(model, tx, context.mesh, context.rules)

    @nnx.jit
    def sft_step(model, optimizer, inputs, targets, mask):
        with dispatch.use(context):
            loss, grads = nnx.value_and_grad(sft_loss)(model, inputs, targets, mask)
            optimizer.update(model, grads)
        return loss

    losses = []
    for step in range(cfg.steps):
        demos = []
        for i in range(cfg.sequences_per_step):
            env = envs[int(rng.integers(len(envs)))]
            demos.append(env.demonstration(env.sample_task(rng, f"sft-{step}-{i}")))
        inputs, targets, mask, count = pack_sequences(demos, rows=cfg.rows, row_len=cfg.row_len,
                                                      max_tokens=cfg.max_tokens)
        if count == 0:
            raise ValueError("no demonstration fits sft.rows x sft.row_len / sft.max_tokens")
        batch = shard_batch(share((inputs, targets, mask)), context.mesh, context.rules)
        losses.append(float(sft_step(model, optimizer, *batch)))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
