"""The learner: one optax step of the corrected objective on a packed batch, over a device mesh.

The model runs on the packed rows; the final-norm hidden state before each policy token and the LM
head go to ``policy_loss``, which never materialises ``[tokens, vocab]`` logits. Parameters and
Adam's moments are split per ``ShardingRules`` (FSDP x tensor x expert), the batch over the data
axes. The step is one ``jax.jit`` whose output shardings equal its input shardings (the state
never moves), with the model's activation constraints, the expert-parallel MoE and the
vocabulary-parallel LM head active during its trace (``ParallelContext``). Gradients are reduced
by the partitioner (reduce-scatter onto the FSDP shards, all-reduce over ``data``).

``model`` and ``optimizer`` stay ordinary ``nnx`` objects holding global arrays, so
``trainer_jax.checkpoint.Checkpointer`` saves them sharded and restores onto whatever mesh the
target learner uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer_jax.batching import PackedInputs
from trainer_jax.config import OptimizerConfig
from trainer_jax.models import Qwen3
from trainer_jax.objective import Metrics, ObjectiveConfig, TokenBatch, policy_loss
from trainer_jax.parallel import dispatch, hooks
from trainer_jax.parallel.context import ParallelContext
from trainer_jax.parallel.mesh import make_mesh
from trainer_jax.parallel.rules import ShardingRules
from trainer_jax.parallel.sharding import (
    init_sharded_model,
    leading_axis_shardings,
    shard_batch,
    shard_model,
)


@dataclasses.dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    metrics: Metrics


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    warmup = optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1))
    main = (optax.constant_schedule(cfg.learning_rate) if cfg.schedule == "constant"
            else optax.cosine_decay_schedule(cfg.learning_rate, cfg.decay_steps))
    schedule = optax.join_schedules([warmup, main], [cfg.warmup_steps]) if cfg.warmup_steps else main
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


def policy_hidden(model: Qwen3, inputs: PackedInputs, micro_rows: int | None = None) -> jax.Array:
    """Final-norm hidden states ``[N, D]`` that predict each policy token.

    ``micro_rows``: run the rows through the model that many at a time, each micro-batch under
    ``jax.checkpoint`` so the backward pass recomputes one micro-batch's activations at a time;
    rows are independent (packing never crosses a row), so the result is the one-shot forward.
    Micro-batch ``c`` takes rows ``c, c + n, c + 2n, ...`` (n micro-batches): with rows split over
    the data axes in contiguous blocks, every device keeps its own rows in every micro-batch.
    """
    if (layout := hooks.override("sequence_layout")) is not None:  # context parallelism: zigzag rows
        inputs = layout(inputs)
    ids, pos, seg = inputs.input_ids, inputs.positions, inputs.segment_ids
    rows = ids.shape[0]
    if not micro_rows or micro_rows >= rows:
        hidden = model.hidden_states(ids, positions=pos, segment_ids=seg)
    else:
        if rows % micro_rows:
            raise ValueError(f"train.micro_rows={micro_rows} must divide train.rows={rows}")
        n = rows // micro_rows
        split = lambda x: x.reshape(micro_rows, n, *x.shape[1:]).swapaxes(0, 1)
        graphdef, state = nnx.split(model)

        @jax.checkpoint
        def forward(state, chunk):
            chunk_ids, chunk_pos, chunk_seg = chunk
            return nnx.merge(graphdef, state).hidden_states(chunk_ids, positions=chunk_pos,
                                                            segment_ids=chunk_seg)

        parts = jax.lax.map(lambda chunk: forward(state, chunk), (split(ids), split(pos), split(seg)))
        hidden = parts.swapaxes(0, 1).reshape(rows, *parts.shape[2:])
    if (gather := hooks.override("token_gather")) is not None:  # rows' blocks on several devices
        return gather(hidden, inputs.token_rows, inputs.token_cols)
    return hidden[inputs.token_rows, inputs.token_cols]


def lm_head(model: Qwen3, dtype: Any) -> jax.Array:
    """The LM head in the compute dtype (``model.dtype: bfloat16`` keeps fp32 parameters; the
    kernel takes h and W in one dtype, and the cast's gradient lands on the fp32 parameter)."""
    return model.lm_head_weight().astype(dtype)


def loss_and_metrics(model: Qwen3, inputs: PackedInputs, batch: TokenBatch, objective: ObjectiveConfig,
                     micro_rows: int | None = None) -> tuple[jax.Array, Metrics]:
    """The objective of a packed batch under ``model`` (no mesh constraints: analysis, tests)."""
    hidden = policy_hidden(model, inputs, micro_rows)
    return policy_loss(hidden, lm_head(model, hidden.dtype), batch, objective)


def sharded_optimizer(model: nnx.Module, tx: optax.GradientTransformation, mesh: Mesh,
                      rules: ShardingRules) -> nnx.Optimizer:
    """``nnx.Optimizer(model, tx, wrt=nnx.Param)`` with its state created already sharded."""
    model_def, params = nnx.split(model)
    build = lambda p: nnx.Optimizer(nnx.merge(model_def, p), tx, wrt=nnx.Param)
    opt_def, abstract = nnx.split(nnx.eval_shape(build, params))
    shardings = rules.state_shardings(abstract, mesh)
    state = jax.jit(lambda p: nnx.state(build(p)), out_shardings=shardings)(params)
    return nnx.merge(opt_def, state)


class Learner:
    """Holds the policy and its optimizer on a device mesh; ``step`` applies one update.

    One device is the degenerate mesh (``mesh=None``: the first device), so the same program
    runs from a laptop to a TPU slice. ``micro_rows``: the rows go through the model that many at
    a time (each micro-batch rematerialised in the backward pass), so a step's batch does not
    depend on the memory one forward needs; the loss and its gradient are those of the whole
    batch. ``model`` is resharded in place (pass one from ``init_sharded_model`` / ``load_hf_sharded``
    to never hold it whole). ``donate``: the step reuses the old state's buffers for the new
    state (halves peak state memory); arrays taken from the model before a step are then invalid.
    ``expert_parallel`` / ``vocab_parallel``: use the shard_map MoE / LM-head implementations
    (off: the partitioner's own program, for comparisons). ``context_attention``: ``ring`` or
    ``all_gather`` under context parallelism (``mesh.context_attention``).
    """

    def __init__(self, model: nnx.Module, optimizer: OptimizerConfig, objective: ObjectiveConfig,
                 mesh: Mesh | None = None, rules: ShardingRules | None = None, *, donate: bool = True,
                 expert_parallel: bool = True, vocab_parallel: bool = True, micro_rows: int | None = None,
                 context_attention: str = "ring"):
        mesh = mesh if mesh is not None else make_mesh(devices=jax.devices()[:1])
        self._configure(mesh, rules if rules is not None else ShardingRules.for_model(model.config),
                        objective, micro_rows, expert_parallel, vocab_parallel, context_attention)
        self.model = shard_model(model, mesh, self.rules)
        self.optimizer = sharded_optimizer(self.model, make_optimizer(optimizer), mesh, self.rules)
        self._build(*nnx.split((self.model, self.optimizer)), donate=donate)

    def _configure(self, mesh: Mesh, rules: ShardingRules, objective: ObjectiveConfig,
                   micro_rows: int | None, expert_parallel: bool, vocab_parallel: bool,
                   context_attention: str = "ring") -> None:
        self.mesh, self.rules, self.objective, self.micro_rows = mesh, rules, objective, micro_rows
        self.context = ParallelContext(mesh, rules, expert_parallel, vocab_parallel, context_attention)

    def _build(self, graphdef: Any, state: Any, *, donate: bool) -> None:
        """The jitted step and loss for a (model, optimizer) of this structure."""
        self._graphdef = graphdef
        self.state_shardings = self.rules.state_shardings(state, self.mesh)
        replicated = NamedSharding(self.mesh, P())
        self._step = jax.jit(self._step_fn, donate_argnums=(0,) if donate else (),
                             out_shardings=(self.state_shardings, replicated, replicated, replicated))
        self._eval = jax.jit(self._eval_fn, out_shardings=(replicated, replicated))
        self._compiled_steps: dict[Any, jax.stages.Compiled] = {}

    @classmethod
    def compile_abstract(cls, build_model: Any, optimizer: OptimizerConfig, objective: ObjectiveConfig,
                         mesh: Mesh, rules: ShardingRules, inputs: PackedInputs, batch: TokenBatch, *,
                         micro_rows: int | None = None, expert_parallel: bool = True,
                         vocab_parallel: bool = True, context_attention: str = "ring") -> jax.stages.Compiled:
        """The step compiled for a policy that is never allocated: ``build_model()`` runs under
        ``nnx.eval_shape``, so XLA's memory analysis is available at sizes that do not fit here."""
        self = object.__new__(cls)
        self._configure(mesh, rules, objective, micro_rows, expert_parallel, vocab_parallel,
                        context_attention)
        tx = make_optimizer(optimizer)

        def build():
            model = build_model()
            return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

        graphdef, state = nnx.split(nnx.eval_shape(build))
        self._build(graphdef, state, donate=True)
        spec = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        state = jax.tree.map(spec, state, self.state_shardings)
        placed = [jax.tree.map(spec, t, leading_axis_shardings(t, mesh, rules)) for t in (inputs, batch)]
        return self._step.lower(state, *placed).compile()

    @classmethod
    def create(cls, model_config: Any, optimizer: OptimizerConfig, objective: ObjectiveConfig,
               mesh: Mesh, rules: ShardingRules | None = None, *, seed: int = 0, dtype: Any = None,
               param_dtype: Any = None, moe_impl: str | None = None, **kwargs: Any) -> Learner:
        """A learner for a freshly initialised model, created sharded (``init_sharded_model``)."""
        rules = rules if rules is not None else ShardingRules.for_model(model_config)
        model = init_sharded_model(model_config, mesh, rules, seed=seed, dtype=dtype,
                                   param_dtype=param_dtype, moe_impl=moe_impl)
        return cls(model, optimizer, objective, mesh, rules, **kwargs)

    # -- traced functions ----------------------------------------------------------------------------

    def _loss(self, model: nnx.Module, inputs: PackedInputs, batch: TokenBatch) -> tuple[jax.Array, Metrics]:
        hidden = policy_hidden(model, inputs, self.micro_rows)
        hidden = self.context.constrain(hidden, ("tokens", "act_embed"))  # batch axes (+ context)
        return policy_loss(hidden, lm_head(model, hidden.dtype), batch, self.objective)

    def _step_fn(self, state: Any, inputs: PackedInputs, batch: TokenBatch):
        with dispatch.use(self.context):
            model, optimizer = nnx.merge(self._graphdef, state)
            (loss, metrics), grads = nnx.value_and_grad(self._loss, has_aux=True)(model, inputs, batch)
            # Gradients land on the parameters' shards (a reduce-scatter, not an all-reduce).
            grads = jax.tree.map(jax.lax.with_sharding_constraint, grads,
                                 self.rules.state_shardings(grads, self.mesh))
            optimizer.update(model, grads)
            return nnx.state((model, optimizer)), loss, optax.tree.norm(grads), metrics

    def _eval_fn(self, state: Any, inputs: PackedInputs, batch: TokenBatch):
        with dispatch.use(self.context):
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


def sft_loss(model: Qwen3, inputs: PackedInputs, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked next-token cross-entropy for the warm start (full logits: SFT runs on tiny models)."""
    hidden = policy_hidden(model, inputs)
    logits = jnp.einsum("nd,dv->nv", hidden, model.lm_head_weight().astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)
