"""Putting parameters and batches onto a mesh: shard, initialise sharded, load HF sharded.

All functions work unchanged with several processes (``jax.distributed``): arrays are built
with ``make_array_from_callback``, so each process only transfers the shards its own devices hold.
The convention for host data (batches, HF tensors) is that every process passes the same global
value.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer_jax.parallel.rules import ShardingRules


def put_global(x: Any, sharding: NamedSharding) -> jax.Array:
    """``x`` (host array, or a jax.Array on any devices) as a global array with ``sharding``."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.jit(lambda y: y, out_shardings=sharding)(x)  # global -> global reshard
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _rules(model: Any, rules: ShardingRules | None) -> ShardingRules:
    return rules if rules is not None else ShardingRules.for_model(getattr(model, "config", None))


def model_shardings(model: nnx.Module, mesh: Mesh, rules: ShardingRules | None = None) -> Any:
    """NamedShardings of the model's state; every parameter must have a rule (else ValueError)."""
    return _rules(model, rules).state_shardings(nnx.state(model), mesh, strict=True)


def shard_model(model: nnx.Module, mesh: Mesh, rules: ShardingRules | None = None) -> nnx.Module:
    """Move ``model``'s parameters onto ``mesh`` per ``rules``, in place, one tensor at a time.

    Each original buffer is released as soon as its sharded copy exists, so peak memory is the
    sharded model plus one tensor. Returns ``model``.
    """
    state = nnx.state(model)
    shardings = model_shardings(model, mesh, rules)
    nnx.update(model, jax.tree.map(put_global, state, shardings))
    return model


def init_sharded_model(cfg: Any, mesh: Mesh, rules: ShardingRules | None = None, *,
                       seed: int = 0, dtype: Any = None, param_dtype: Any = None,
                       moe_impl: str | None = None, attention_impl: str | None = None
                       ) -> nnx.Module:
    """A randomly initialised Qwen3 whose parameters are created sharded (never whole anywhere).

    Same values as ``models.init_model(cfg, seed=seed)``: the initialisers run inside one jit
    whose outputs carry the parameter shardings.
    """
    import jax.numpy as jnp

    from trainer_jax.models import init_model

    dtype = jnp.float32 if dtype is None else dtype
    build = lambda: init_model(cfg, dtype=dtype, param_dtype=param_dtype, seed=seed, moe_impl=moe_impl,
                               attention_impl=attention_impl)
    abstract = nnx.eval_shape(build)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = _rules(abstract, rules).state_shardings(abstract_state, mesh, strict=True)
    state = jax.jit(lambda: nnx.split(build())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def load_hf_sharded(path: str | os.PathLike, mesh: Mesh, rules: ShardingRules | None = None, *,
                    dtype: Any = None, param_dtype: Any = None, moe_impl: str | None = None,
                    attention_impl: str | None = None) -> tuple[nnx.Module, Any]:
    """``models.load_hf`` onto a mesh: tensors are read into host memory (the CPU backend), then
    each is sharded and its host copy dropped. Returns ``(model, Qwen3Config)``.

    Host RAM must hold the model once (per process); accelerator memory only ever holds shards.
    """
    import jax.numpy as jnp

    from trainer_jax.models import load_hf

    dtype = jnp.float32 if dtype is None else dtype
    try:
        # This process's own CPU: with several processes on the CPU platform, jax.devices("cpu")
        # lists every process's devices, and process 1 would load onto process 0's.
        host = jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu: load onto the default device
        host = None
    if host is None:
        model, cfg = load_hf(path, dtype, param_dtype=param_dtype, moe_impl=moe_impl,
                             attention_impl=attention_impl)
    else:
        with jax.default_device(host):
            model, cfg = load_hf(path, dtype, param_dtype=param_dtype, moe_impl=moe_impl,
                                 attention_impl=attention_impl)
    return shard_model(model, mesh, rules), cfg


def leading_axis_shardings(tree: Any, mesh: Mesh, rules: ShardingRules) -> Any:
    """Batch pytrees: the first dimension of every array split over the ``batch`` axes."""
    def one(x: Any) -> NamedSharding:
        shape = np.shape(x)
        if not shape:
            return NamedSharding(mesh, P())
        return rules.sharding(("batch",) + (None,) * (len(shape) - 1), shape, mesh)

    return jax.tree.map(one, tree)


def shard_batch(tree: Any, mesh: Mesh, rules: ShardingRules | None = None) -> Any:
    """Place a batch pytree (``PackedInputs``, ``TokenBatch``) split along its leading axis.

    Every process must pass the same global batch (e.g. broadcast by process 0).
    """
    rules = rules if rules is not None else ShardingRules()
    return jax.tree.map(put_global, tree, leading_axis_shardings(tree, mesh, rules))
