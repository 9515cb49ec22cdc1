"""Where weights to export come from: an HF directory, a mixrl orbax checkpoint, or live params.

``open_source`` turns any of them into a ``Source``: the HF config dict, a factory returning a
fresh iterator of ``(hf_name, array)`` pairs, and the directory tokenizer files come from.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from convert.hf_checkpoint import CONFIG_NAME, CheckpointError, HFCheckpoint
from convert.orbax_io import OrbaxCheckpoint, is_orbax_checkpoint
from convert.qwen3_config import Qwen3Config
from convert.trainer_checkpoint import is_trainer_checkpoint, trainer_checkpoint_tensors

TensorIter = Iterator[tuple[str, np.ndarray]]


class SourceError(ValueError):
    """The weights to export cannot be found or read."""


@dataclasses.dataclass
class Source:
    hf_config: dict
    open: Callable[[], TensorIter]
    files_dir: Path | None = None
    reiterable: bool = True


def _config_dict(config: Mapping | Qwen3Config | None) -> dict | None:
    if config is None:
        return None
    return config.to_hf_dict() if isinstance(config, Qwen3Config) else dict(config)


def load_config(path: str | os.PathLike) -> dict:
    """An HF config dict from a ``config.json`` file or a directory holding one."""
    p = Path(path)
    p = p / CONFIG_NAME if p.is_dir() else p
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SourceError(f"{p}: cannot read a model config ({e})") from None


def open_source(src, config: Mapping | Qwen3Config | None = None, *,
                step: int | None = None) -> Source:
    """Resolve ``src`` into a ``Source``.

    ``src`` may be a path (HF directory with ``config.json`` + safetensors, a mixrl orbax
    checkpoint, or a trainer training checkpoint, which needs ``config`` and takes ``step``), a
    callable returning an iterator of ``(hf_name, array)``, a mapping ``{hf_name: array}``, or a
    one-shot iterable of pairs. ``config`` (HF dict or ``Qwen3Config``) is required for the last
    three and overrides the stored one for paths.
    """
    cfg = _config_dict(config)
    if isinstance(src, (str, os.PathLike)):
        path = Path(src)
        if is_trainer_checkpoint(path):
            if cfg is None:
                raise SourceError(f"{path} is a training checkpoint, which stores no model "
                                  "config: pass the run's HF config (--config)")
            return Source(cfg, lambda: trainer_checkpoint_tensors(path, cfg, step))
        if is_orbax_checkpoint(path):
            ckpt = OrbaxCheckpoint(path)
            return Source(cfg or ckpt.config, ckpt.tensors, path)
        if (path / CONFIG_NAME).is_file():
            try:
                hf = HFCheckpoint(path)
            except CheckpointError as e:
                raise SourceError(str(e)) from None
            return Source(cfg or hf.config, hf.tensors, path)
        raise SourceError(f"{path}: not an HF directory (config.json + *.safetensors), a mixrl "
                          "orbax checkpoint or a training checkpoint")
    if cfg is None:
        raise SourceError("a config is required when exporting in-memory parameters")
    if callable(src):
        return Source(cfg, src)
    if isinstance(src, Mapping):
        return Source(cfg, lambda: iter(src.items()))
    if isinstance(src, Iterable):
        used = [False]
        it = iter(src)

        def once() -> TensorIter:
            if used[0]:
                raise SourceError("a one-shot iterator of tensors can be read only once; pass a "
                                  "callable returning a fresh iterator")
            used[0] = True
            return it

        return Source(cfg, once, reiterable=False)
    raise SourceError(f"cannot export from {type(src).__name__}")
