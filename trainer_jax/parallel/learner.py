"""``ShardedLearner``: the ``Learner`` interface, one SPMD train step over a device mesh.

Parameters and Adam's moments are split per ``ShardingRules`` (FSDP x tensor x expert), the
batch over the data axes. The step is one ``jax.jit`` whose output shardings equal its input
shardings (the state never moves), with the model's activation constraints, the expert-parallel
MoE and the vocabulary-parallel LM head active during its trace (``ParallelContext``). Gradients
are reduced by the partitioner (reduce-scatter onto the FSDP shards, all-reduce over ``data``).

``model`` and ``optimizer`` stay ordinary ``nnx`` objects holding global arrays, so
``trainer_jax.checkpoint.Checkpointer`` saves them sharded and restores onto whatever mesh the
target learner uses.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer_jax.batching import PackedInputs
from trainer_jax.learner import OptimizerConfig, StepResult, make_optimizer, policy_hidden
from trainer_jax.objective import Metrics, ObjectiveConfig, TokenBatch, policy_loss
from trainer_jax.parallel.context import ParallelContext
from trainer_jax.parallel.rules import ShardingRules
from trainer_jax.parallel.sharding import init_sharded_model, shard_batch, shard_model


def sharded_optimizer(model: nnx.Module, tx: optax.GradientTransformation, mesh: Mesh,
                      rules: ShardingRules) -> nnx.Optimizer:
    """``nnx.Optimizer(model, tx, wrt=nnx.Param)`` with its state created already sharded."""
    model_def, params = nnx.split(model)
    build = lambda p: nnx.Optimizer(nnx.merge(model_def, p), tx, wrt=nnx.Param)
    opt_def, abstract = nnx.split(nnx.eval_shape(build, params))
    shardings = rules.state_shardings(abstract, mesh)
    state = jax.jit(lambda p: nnx.state(build(p)), out_shardings=shardings)(params)
    return nnx.merge(opt_def, state)


class ShardedLearner:
    """Holds the sharded policy and optimizer; ``step`` applies one update (like ``Learner``).

    ``model`` is resharded in place (pass one from ``init_sharded_model`` / ``load_hf_sharded``
    to never hold it whole). ``donate``: the step reuses the old state's buffers for the new
    state (halves peak state memory); arrays taken from the model before a step are then invalid.
    ``expert_parallel`` / ``vocab_parallel``: use the shard_map MoE / LM-head implementations
    (off: the partitioner's own program, for comparisons).
    """

    def __init__(self, model: nnx.Module, optimizer: OptimizerConfig, objective: ObjectiveConfig,
                 mesh: Mesh, rules: ShardingRules | None = None, *, donate: bool = True,
                 expert_parallel: bool = True, vocab_parallel: bool = True):
        self.mesh = mesh
        self.rules = rules if rules is not None else ShardingRules.for_model(model.config)
        self.objective = objective
        self.context = ParallelContext(mesh, self.rules, expert_parallel, vocab_parallel)
        self.model = shard_model(model, mesh, self.rules)
        self.optimizer = sharded_optimizer(self.model, make_optimizer(optimizer), mesh, self.rules)
        self._graphdef, state = nnx.split((self.model, self.optimizer))
        self.state_shardings = self.rules.state_shardings(state, mesh)
        replicated = NamedSharding(mesh, P())
        self._step = jax.jit(self._step_fn, donate_argnums=(0,) if donate else (),
                             out_shardings=(self.state_shardings, replicated, replicated, replicated))
        self._eval = jax.jit(self._eval_fn, out_shardings=(replicated, replicated))
        self._compiled_steps: dict[Any, jax.stages.Compiled] = {}

    @classmethod
    def create(cls, model_config: Any, optimizer: OptimizerConfig, objective: ObjectiveConfig,
               mesh: Mesh, rules: ShardingRules | None = None, *, seed: int = 0, dtype: Any = None,
               param_dtype: Any = None, moe_impl: str | None = None, **kwargs: Any) -> ShardedLearner:
        """A learner for a freshly initialised model, created sharded (``init_sharded_model``)."""
        rules = rules if rules is not None else ShardingRules.for_model(model_config)
        model = init_sharded_model(model_config, mesh, rules, seed=seed, dtype=dtype,
                                   param_dtype=param_dtype, moe_impl=moe_impl)
        return cls(model, optimizer, objective, mesh, rules, **kwargs)

    # -- traced functions ----------------------------------------------------------------------------

    def _loss(self, model: nnx.Module, inputs: PackedInputs, batch: TokenBatch) -> tuple[jax.Array, Metrics]:
        hidden = self.context.constrain(policy_hidden(model, inputs), ("batch", "act_embed"))
        return policy_loss(hidden, model.lm_head_weight(), batch, self.objective)

    def _step_fn(self, state: Any, inputs: PackedInputs, batch: TokenBatch):
        with self.context.use():
            model, optimizer = nnx.merge(self._graphdef, state)
            (loss, metrics), grads = nnx.value_and_grad(self._loss, has_aux=True)(model, inputs, batch)
            # Gradients land on the parameters' shards (a reduce-scatter, not an all-reduce).
            grads = jax.tree.map(jax.lax.with_sharding_constraint, grads,
                                 self.rules.state_shardings(grads, self.mesh))
            optimizer.update(model, grads)
            return nnx.state((model, optimizer)), loss, optax.tree.norm(grads), metrics

    def _eval_fn(self, state: Any, inputs: PackedInputs, batch: TokenBatch):
        with self.context.use():
            model, _ = nnx.merge(self._graphdef, state)
            return self._loss(model, inputs, batch)

    # -- the Learner interface -------------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        return int(self.optimizer.step.get_value())

    def state(self) -> Any:
        """The current (model, optimizer) state as one pytree of global arrays."""
        return nnx.state((self.model, self.optimizer))

    def place(self, inputs: PackedInputs, batch: TokenBatch) -> tuple[PackedInputs, TokenBatch]:
        """The batch split over the mesh's batch axes (every process passes the same batch)."""
        return shard_batch(inputs, self.mesh, self.rules), shard_batch(batch, self.mesh, self.rules)

    def _compiled(self, state: Any, inputs: PackedInputs, batch: TokenBatch) -> jax.stages.Compiled:
        """The step compiled ahead of time for this batch signature (cached): one compile per
        shape, shared by ``step`` and ``compile_step``."""
        key = (jax.tree.structure((state, inputs, batch)),
               tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves((state, inputs, batch))))
        if key not in self._compiled_steps:
            self._compiled_steps[key] = self._step.lower(state, inputs, batch).compile()
        return self._compiled_steps[key]

    def step(self, inputs: PackedInputs, batch: TokenBatch) -> StepResult:
        inputs, batch = self.place(inputs, batch)
        state = self.state()
        new_state, loss, grad_norm, metrics = self._compiled(state, inputs, batch)(state, inputs, batch)
        nnx.update((self.model, self.optimizer), new_state)
        return StepResult(float(loss), float(grad_norm), metrics)

    def evaluate(self, inputs: PackedInputs, batch: TokenBatch) -> tuple[float, Metrics]:
        inputs, batch = self.place(inputs, batch)
        loss, metrics = self._eval(self.state(), inputs, batch)
        return float(loss), metrics

    def compile_step(self, inputs: PackedInputs, batch: TokenBatch) -> jax.stages.Compiled:
        """The compiled step for this batch shape (``memory_analysis()``, ``as_text()``); ``step``
        reuses it."""
        inputs, batch = self.place(inputs, batch)
        state = self.state()
        return self._compiled(state, inputs, batch)
