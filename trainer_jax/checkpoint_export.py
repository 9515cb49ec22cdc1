"""Read the parameters out of a trainer training checkpoint (``trainer_jax.checkpoint``) as HF tensors.

A training checkpoint directory is an orbax ``CheckpointManager`` root: ``<root>/<step>/state``
holds ``{"params": nnx.State of the model's Params, "optimizer": ...}`` and ``<root>/<step>/meta``
the loop's JSON. It does not store the model config, so the caller supplies it (the run's HF
config). Only ``params`` is restored (never the optimizer state), into an abstractly built
model, and ``trainer_jax.models.hf_params.iter_hf_tensors`` maps it to HF names, the one place
that mapping lives.

This lives on the trainer side because it needs the trainer's model; ``convert`` (below both the
trainer and the samplers) reaches it through the ``mixrl.convert`` entry point ``register``, so
``mixrl-convert export/quantize/publish --in <training checkpoint>`` work. jax, flax and orbax
are imported only when reading: detecting a checkpoint runs for every path ``mixrl-convert``
sees and must stay cheap.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from convert.qwen3_config import Qwen3Config

STATE_ITEM = "state"  # the item name trainer_jax.checkpoint.Checkpointer saves params under
REQUIRES = ("jax", "flax", "orbax.checkpoint")  # what reading imports; checked before it starts


class TrainerCheckpointError(ValueError):
    """Not a training checkpoint, no such step, or its params do not fit the config."""


def checkpoint_steps(path: str | os.PathLike) -> list[int]:
    """The steps with a ``<step>/state`` directory under ``path``, ascending."""
    p = Path(path)
    if not p.is_dir():
        return []
    return sorted(int(d.name) for d in p.iterdir()
                  if d.name.isdigit() and (d / STATE_ITEM).is_dir())


def is_trainer_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a training checkpoint root (holds at least one complete step)."""
    return bool(checkpoint_steps(path))


def trainer_checkpoint_tensors(path: str | os.PathLike, hf_config: Mapping | Qwen3Config,
                               step: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, array)`` for the params of ``step`` (default: the latest), as stored."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from trainer_jax.models import Qwen3
    from trainer_jax.models.hf_params import iter_hf_tensors

    cfg = hf_config if isinstance(hf_config, Qwen3Config) else Qwen3Config.from_hf_dict(
        dict(hf_config))
    steps = checkpoint_steps(path)
    if not steps:
        raise TrainerCheckpointError(f"{path}: no training checkpoint steps (<step>/state)")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise TrainerCheckpointError(f"{path}: no step {step}; have {steps}")
    state_dir = Path(path).absolute() / str(step) / STATE_ITEM
    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(state_dir)
        tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
        if "params" not in tree:
            raise TrainerCheckpointError(f"{state_dir}: no 'params' in the checkpoint")
        params_meta = {"params": tree["params"]}
        restore_args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray),
                                    params_meta)
        restored = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
            item=params_meta, restore_args=restore_args, partial_restore=True))["params"]
    model = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    try:
        restored = _like(nnx.to_pure_dict(state), _strip_value(restored), ())
    except TrainerCheckpointError as e:
        raise TrainerCheckpointError(f"{state_dir}: params do not fit a {cfg.model_type} model "
                                     f"of this config: {e}") from None
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)
    yield from iter_hf_tensors(model)


def _like(template, tree, path: tuple):
    """``tree`` re-keyed like ``template`` (orbax turns int keys into str), shapes checked."""
    if isinstance(template, dict):
        if not isinstance(tree, dict):
            raise TrainerCheckpointError(f"{'/'.join(map(str, path))} is not a subtree")
        extra = set(map(str, tree)) - set(map(str, template))
        if extra:
            raise TrainerCheckpointError(f"unexpected params {sorted(extra)} under "
                                         f"{'/'.join(map(str, path)) or 'the root'}")
        out = {}
        for k, sub in template.items():
            if k in tree:
                v = tree[k]
            elif str(k) in tree:
                v = tree[str(k)]
            else:
                raise TrainerCheckpointError(f"missing param {'/'.join(map(str, path + (k,)))}")
            out[k] = _like(sub, v, path + (k,))
        return out
    if tuple(np.shape(tree)) != tuple(template.shape):
        raise TrainerCheckpointError(f"param {'/'.join(map(str, path))} has shape "
                                     f"{tuple(np.shape(tree))}, expected {tuple(template.shape)}")
    return tree


def _strip_value(tree):
    """nnx Variables are saved as ``{"value": array}``; pure dicts hold the array itself."""
    if isinstance(tree, dict):
        if set(tree) == {"value"}:
            return tree["value"]
        return {k: _strip_value(v) for k, v in tree.items()}
    return tree


def register() -> None:
    """Entry point (group ``mixrl.convert``): make ``convert.sources`` read training checkpoints."""
    from convert.plugins import register_source_reader

    register_source_reader("trainer_checkpoint", is_trainer_checkpoint,
                           trainer_checkpoint_tensors, description="a training checkpoint",
                           requires=REQUIRES)
