"""HF checkpoint names <-> the flax.nnx Qwen3 parameters.

One table, ``param_map``, says for each HF tensor which model parameter holds it and how it is laid
out. Loading and saving both walk that table, so they cannot disagree. HF linears are ``[out, in]``,
ours ``[in, out]``; MoE experts are one HF tensor per expert, one stacked ``[E, ...]`` array here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.qwen3_config import Qwen3Config, hf_tensor_shapes


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one HF tensor lives in the model: a parameter, optionally one expert's slice of it."""

    param: nnx.Variable
    transpose: bool
    expert: int | None = None


def param_map(model) -> dict[str, ParamSlot]:
    """HF tensor name -> slot, for every tensor the model's config has (see ``hf_tensor_shapes``)."""
    cfg: Qwen3Config = model.config
    slots: dict[str, ParamSlot] = {
        "model.embed_tokens.weight": ParamSlot(model.embed_tokens.embedding, False),
        "model.norm.weight": ParamSlot(model.norm.weight, False),
    }
    if model.lm_head is not None:
        slots["lm_head.weight"] = ParamSlot(model.lm_head.kernel, True)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        attn = layer.self_attn
        slots.update({
            f"{p}.input_layernorm.weight": ParamSlot(layer.input_layernorm.weight, False),
            f"{p}.post_attention_layernorm.weight":
                ParamSlot(layer.post_attention_layernorm.weight, False),
            f"{p}.self_attn.q_norm.weight": ParamSlot(attn.q_norm.weight, False),
            f"{p}.self_attn.k_norm.weight": ParamSlot(attn.k_norm.weight, False),
        })
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            slots[f"{p}.self_attn.{proj}.weight"] = ParamSlot(getattr(attn, proj).kernel, True)
        if cfg.layer_is_sparse(i):
            slots[f"{p}.mlp.gate.weight"] = ParamSlot(layer.mlp.gate.kernel, True)
            for e in range(cfg.num_experts):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    slots[f"{p}.mlp.experts.{e}.{proj}.weight"] = ParamSlot(
                        getattr(layer.mlp, proj), True, expert=e)
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                slots[f"{p}.mlp.{proj}.weight"] = ParamSlot(getattr(layer.mlp, proj).kernel, True)
    expected = set(hf_tensor_shapes(cfg))
    assert set(slots) == expected, sorted(set(slots) ^ expected)
    return slots


def load_hf_tensors(model, get_tensor: Callable[[str], np.ndarray]) -> None:
    """Fill every parameter of ``model`` from ``get_tensor(hf_name)``, one tensor at a time.

    Shapes are checked against the config before anything is assigned; stacked expert arrays are
    assembled in host memory one layer at a time.
    """
    shapes = hf_tensor_shapes(model.config)
    stacked: dict[int, np.ndarray] = {}
    pending: list[tuple[nnx.Variable, np.ndarray]] = []
    for name, slot in param_map(model).items():
        arr = np.asarray(get_tensor(name))
        if tuple(arr.shape) != shapes[name]:
            raise ValueError(f"tensor {name!r} has shape {tuple(arr.shape)}, the config says "
                             f"{shapes[name]}")
        if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.kind != "V":
            raise ValueError(f"tensor {name!r} has dtype {arr.dtype}; expected a float tensor "
                             "(quantized exports load through the sampler's recipes)")
        value = arr.astype(np.float32)
        if slot.transpose:
            value = value.T
        if slot.expert is None:
            pending.append((slot.param, value))
            continue
        key = id(slot.param)
        if key not in stacked:
            stacked[key] = np.zeros(slot.param.get_value().shape, np.float32)
            pending.append((slot.param, stacked[key]))
        stacked[key][slot.expert] = value
    for param, value in pending:
        param.set_value(jnp.asarray(value, dtype=param.get_value().dtype))


def iter_hf_tensors(model, dtype=None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, array)`` in HF layout, one tensor at a time (cast to ``dtype`` if given)."""
    for name, slot in param_map(model).items():
        value = np.asarray(slot.param.get_value())
        if slot.expert is not None:
            value = value[slot.expert]
        if slot.transpose:
            value = value.T
        value = np.ascontiguousarray(value)
        yield name, value.astype(dtype) if dtype is not None else value
