"""The trainer on a device mesh: data / FSDP / tensor / expert parallelism, multi-process JAX.

Public API (imported lazily: ``trainer_jax.models`` imports ``trainer_jax.parallel.hooks``, so
this package must not import the model at import time):

- ``make_mesh(cfg.mesh)`` / ``make_mesh(fsdp=2, tensor=4)``: the ``Mesh`` (``mesh``)
- ``ShardingRules``: partitioning rules for every parameter and activation (``rules``)
- ``shard_model``, ``init_sharded_model``, ``load_hf_sharded``: parameters onto the mesh
  (``sharding``)
- ``init_distributed(cfg.distributed)``: ``jax.distributed.initialize`` from config / environment
  (``distributed``)
- ``iter_gathered_hf_tensors``, ``publish_sharded``: weight publication from sharded params
  (``publish``)
- ``ParallelContext``, ``vocab_parallel_linear_logsumexp``: the shard_map pieces (``context``,
  ``vocab``, ``moe``)

See docs/scale_out.md.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AXES": "mesh", "BATCH_AXES": "mesh", "make_mesh": "mesh", "mesh_shape": "mesh",
    "ShardingRules": "rules", "LOGICAL_AXES": "rules", "PARAM_RULES": "rules",
    "ParallelContext": "context",
    "shard_model": "sharding", "init_sharded_model": "sharding", "load_hf_sharded": "sharding",
    "put_global": "sharding", "shard_batch": "sharding",
    "init_distributed": "distributed", "DistributedInfo": "distributed",
    "iter_gathered_hf_tensors": "publish", "publish_sharded": "publish",
    "vocab_parallel_linear_logsumexp": "vocab", "vocab_parallel_lse_and_logits_at": "vocab",
    "moe_forward": "moe",
    "per_device_bytes": "memory", "max_device_bytes": "memory", "state_memory_report": "memory",
    "compiled_memory": "memory",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainer_jax.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainer_jax.parallel.{_EXPORTS[name]}"), name)
