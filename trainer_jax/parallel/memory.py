"""Per-device memory of sharded state: from the arrays' shards and from XLA's memory analysis."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax


def per_device_bytes(tree: Any) -> dict[jax.Device, int]:
    """Bytes each (local) device holds for the arrays of ``tree`` (its own shards only)."""
    out: dict[jax.Device, int] = defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                out[shard.device] += shard.data.nbytes
    return dict(out)


def max_device_bytes(tree: Any) -> int:
    """The largest per-device footprint of ``tree`` (what must fit on one accelerator)."""
    return max(per_device_bytes(tree).values(), default=0)


def state_memory_report(model: Any, optimizer: Any) -> dict[str, int]:
    """Largest per-device bytes of the parameters, the optimizer state and both, plus totals."""
    from flax import nnx

    params = nnx.state(model, nnx.Param)
    opt = nnx.state(optimizer)
    total = lambda t: sum(x.nbytes for x in jax.tree.leaves(t) if isinstance(x, jax.Array))
    return {
        "params_bytes_per_device": max_device_bytes(params),
        "optimizer_bytes_per_device": max_device_bytes(opt),
        "state_bytes_per_device": max_device_bytes((params, opt)),
        "state_bytes_total": total((params, opt)),
    }


def compiled_memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """XLA's per-device memory analysis of a compiled SPMD program (bytes)."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes", "generated_code_size_in_bytes")
    return {f.removesuffix("_in_bytes") + "_bytes": int(getattr(m, f)) for f in fields if hasattr(m, f)}
