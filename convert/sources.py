"""Where weights to export come from: an HF directory, a mixrl orbax checkpoint, or live params.

``open_source`` turns any of them into a ``Source``: the HF config dict, a factory returning a
fresh iterator of ``(hf_name, array)`` pairs, and the directory tokenizer files come from.
Kinds of directory that only a package above ``convert`` can read (a trainer training
checkpoint) come from source readers registered in ``convert.plugins``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from convert.hf_checkpoint import CONFIG_NAME, CheckpointError, HFCheckpoint
from convert.orbax_io import OrbaxCheckpoint, is_orbax_checkpoint
from convert.plugins import failed_providers, source_readers, unavailable_note
from convert.qwen3_config import Qwen3Config

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
    checkpoint, or a directory a registered source reader detects, e.g. a trainer training
    checkpoint, which needs ``config`` and takes ``step``), a callable returning an iterator of
    ``(hf_name, array)``, a mapping ``{hf_name: array}``, or a one-shot iterable of pairs.
    ``config`` (HF dict or ``Qwen3Config``) is required for the last three and overrides the
    stored one for paths.
    """
    cfg = _config_dict(config)
    if isinstance(src, (str, os.PathLike)):
        return _open_path(Path(src), cfg, step)
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


def _open_path(path: Path, cfg: dict | None, step: int | None) -> Source:
    # Registered readers first: they detect directories by their own layout (a training
    # checkpoint's <step>/state), which must win over the generic markers below.
    readers = source_readers()
    for reader in readers:
        if reader.detect(path):
            if cfg is None:
                raise SourceError(f"{path} is {reader.description}, which stores no model "
                                  "config: pass the run's HF config (--config)")
            reader.check()  # a missing package fails here, before any output is started
            return Source(cfg, functools.partial(reader.open, path, cfg, step))
    if is_orbax_checkpoint(path):
        ckpt = OrbaxCheckpoint(path)
        return Source(cfg or ckpt.config, ckpt.tensors, path)
    if (path / CONFIG_NAME).is_file():
        try:
            hf = HFCheckpoint(path)
        except CheckpointError as e:
            raise SourceError(str(e)) from None
        return Source(cfg or hf.config, hf.tensors, path)
    kinds = ["an HF directory (config.json + *.safetensors)", "a mixrl orbax checkpoint",
             *(r.description for r in readers)]
    # A provider that failed to load might have recognized this path: say why it is missing.
    note = unavailable_note() if failed_providers() else ""
    raise SourceError(f"{path}: not {', '.join(kinds[:-1])} or {kinds[-1]}{note}")
