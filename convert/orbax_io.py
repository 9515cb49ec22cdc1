"""The trainer's starting checkpoint: HF-named tensors in an orbax PyTree checkpoint.

Layout of a checkpoint directory ``CKPT/``::

    CKPT/config.json         the HF model config (Qwen3 / Qwen3-MoE)
    CKPT/mixrl_orbax.json    {"layout": "hf_names", "layout_version": 1}
    CKPT/params/             orbax PyTree checkpoint of a flat dict {hf_name: array}
    CKPT/<tokenizer files>   copied through from the HF directory

The tree keys are HF tensor names and the arrays keep HF layouts (``[out, in]`` linears, one
tensor per expert) and their stored dtype, so the mapping to the model lives in one place
(``trainer_jax.models.hf_params``): the trainer restores with
``load_hf_tensors(model, OrbaxCheckpoint(CKPT).get)`` and saves with
``save_orbax(CKPT, iter_hf_tensors(model), cfg)``. This is independent of how the trainer lays
out its own optimizer state.

Orbax writes a PyTree in one call, so ``save_orbax`` holds the whole parameter set in host
memory (as the trainer does anyway). Reading is partial: ``OrbaxCheckpoint.tensors`` restores
one layer's tensors at a time.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from convert.atomic import atomic_directory
from convert.hf_checkpoint import CONFIG_NAME, copy_passthrough_files
from convert.qwen3_config import Qwen3Config

PARAMS_DIR = "params"
MARKER = "mixrl_orbax.json"
LAYOUT = {"layout": "hf_names", "layout_version": 1}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class OrbaxCheckpointError(ValueError):
    """A directory is not a mixrl orbax checkpoint, or orbax cannot read it."""


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / MARKER).is_file() and (p / PARAMS_DIR).is_dir()


def _checkpointer():
    import orbax.checkpoint as ocp  # imported lazily: orbax pulls in jax

    return ocp, ocp.PyTreeCheckpointer()


def save_orbax(path: str | os.PathLike, tensors: Iterable[tuple[str, np.ndarray]],
               config: Mapping | Qwen3Config, *, copy_files_from: str | os.PathLike | None = None,
               overwrite: bool = False) -> Path:
    """Write HF-named ``tensors`` and ``config`` as a mixrl orbax checkpoint, atomically."""
    hf_config = config.to_hf_dict() if isinstance(config, Qwen3Config) else dict(config)
    Qwen3Config.from_hf_dict(hf_config)  # validate before writing anything
    tree: dict[str, np.ndarray] = {}
    for name, arr in tensors:
        if name in tree:
            raise OrbaxCheckpointError(f"tensor {name!r} given twice")
        tree[name] = np.asarray(arr)
    if not tree:
        raise OrbaxCheckpointError("no tensors to save")
    path = Path(path)
    with atomic_directory(path, overwrite=overwrite) as stage:
        ocp, ckptr = _checkpointer()
        with ckptr:
            ckptr.save(stage / PARAMS_DIR, tree)
        (stage / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        (stage / MARKER).write_text(json.dumps(LAYOUT) + "\n")
        if copy_files_from is not None:
            copy_passthrough_files(copy_files_from, stage)
    return path


class OrbaxCheckpoint:
    """Read-only view of a mixrl orbax checkpoint: ``config`` plus partially restored tensors."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not is_orbax_checkpoint(self.path):
            raise OrbaxCheckpointError(f"{self.path} is not a mixrl orbax checkpoint (needs "
                                       f"{MARKER} and {PARAMS_DIR}/)")
        try:
            layout = json.loads((self.path / MARKER).read_text())
            self.config: dict = json.loads((self.path / CONFIG_NAME).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise OrbaxCheckpointError(f"{self.path}: unreadable metadata ({e})") from None
        if layout.get("layout") != LAYOUT["layout"]:
            raise OrbaxCheckpointError(f"{self.path / MARKER}: unknown layout {layout!r}")
        ocp, ckptr = _checkpointer()
        try:
            with ckptr:
                meta = ckptr.metadata(self.path / PARAMS_DIR)
        except Exception as e:  # orbax raises a variety of types for a damaged checkpoint
            raise OrbaxCheckpointError(f"{self.path / PARAMS_DIR}: orbax cannot read it "
                                       f"({type(e).__name__}: {e})") from None
        tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
        if tree is None:
            tree = meta
        self._meta = {name: (np.dtype(m.dtype), tuple(m.shape)) for name, m in tree.items()}

    def names(self) -> list[str]:
        return list(self._meta)

    def __contains__(self, name: str) -> bool:
        return name in self._meta

    def info(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        return self._meta[name]

    def restore(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Restore only ``names`` as numpy arrays."""
        names = list(names)
        for n in names:
            if n not in self._meta:
                raise KeyError(f"{self.path}: checkpoint has no tensor {n!r}")
        ocp, ckptr = _checkpointer()
        item = {n: np.zeros(self._meta[n][1], self._meta[n][0]) for n in names}
        restore_args = {n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names}
        try:
            with ckptr:
                out = ckptr.restore(self.path / PARAMS_DIR, args=ocp.args.PyTreeRestore(
                    item=item, restore_args=restore_args, partial_restore=True))
        except Exception as e:
            raise OrbaxCheckpointError(f"{self.path / PARAMS_DIR}: restoring {len(names)} "
                                       f"tensor(s) failed ({type(e).__name__}: {e})") from None
        return {n: np.asarray(out[n]) for n in names}

    def get(self, name: str) -> np.ndarray:
        return self.restore([name])[name]

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield every tensor, restoring one decoder layer (or the non-layer rest) at a time."""
        groups: dict[int, list[str]] = {}
        for name in self._meta:
            m = _LAYER.match(name)
            groups.setdefault(int(m.group(1)) if m else -1, []).append(name)
        for key in sorted(groups):
            restored = self.restore(groups[key])
            for name in groups[key]:
                yield name, restored.pop(name)
