"""HF checkpoint directories: sharded safetensors + index + config.json, read and written lazily.

Reading goes tensor by tensor through the index, so loading a model never holds the whole file set
in memory. Writing fills shards up to ``max_shard_bytes`` in a temp directory that is renamed into
place when complete (``convert.atomic``), so a reader never sees half a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from convert.atomic import atomic_directory
from convert.safetensors_io import SafetensorsError, SafetensorsFile, write_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# Files that travel with the weights unchanged (tokenizer, generation defaults, chat template).
PASSTHROUGH_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


class CheckpointError(ValueError):
    """An HF checkpoint directory is missing files, or its index and files disagree."""


class HFCheckpoint:
    """Read-only view of an HF checkpoint directory: ``config`` plus lazily read tensors."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a directory")
        config_path = self.path / CONFIG_NAME
        if not config_path.exists():
            raise CheckpointError(f"{self.path} has no {CONFIG_NAME}")
        try:
            self.config: dict = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{config_path} is not valid JSON ({e})") from None
        self._weight_map = self._read_weight_map()
        self._files: dict[str, SafetensorsFile] = {}

    def _read_weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is malformed ({e!r})") from None
            for fname in set(weight_map.values()):
                if not (self.path / fname).exists():
                    raise CheckpointError(f"{index} names {fname}, which is missing")
            return dict(weight_map)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path} holds no *.safetensors files")
        weight_map = {}
        for file in files:
            for name in SafetensorsFile(file).keys():
                weight_map[name] = file.name
        return weight_map

    def names(self) -> list[str]:
        return list(self._weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def files(self) -> list[str]:
        return sorted(set(self._weight_map.values()))

    def _file(self, name: str) -> SafetensorsFile:
        try:
            fname = self._weight_map[name]
        except KeyError:
            raise KeyError(f"{self.path}: checkpoint has no tensor {name!r}") from None
        if fname not in self._files:
            self._files[fname] = SafetensorsFile(self.path / fname)
        f = self._files[fname]
        if name not in f:
            raise CheckpointError(f"{self.path / fname}: index lists {name!r}, the file lacks it")
        return f

    def info(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        return self._file(name).info(name)

    def get(self, name: str) -> np.ndarray:
        return self._file(name).get(name)

    def locate(self, name: str) -> tuple[str, int, int]:
        """``(file name, begin, end)``: where the tensor's data bytes lie (absolute offsets)."""
        begin, end = self._file(name).span(name)
        return self._weight_map[name], begin, end

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield every tensor, file by file, one in memory at a time."""
        by_file: dict[str, list[str]] = {}
        for name, fname in self._weight_map.items():
            by_file.setdefault(fname, []).append(name)
        for fname in sorted(by_file):
            for name in by_file[fname]:
                yield name, self.get(name)


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def write_hf_checkpoint(
    path: str | os.PathLike,
    tensors: Iterable[tuple[str, np.ndarray]],
    config: Mapping,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    copy_files_from: str | os.PathLike | None = None,
    extra_json: Mapping[str, Mapping] | None = None,
    overwrite: bool = False,
    on_shard: Callable[[Path, str, dict[str, str]], object] | None = None,
) -> Path:
    """Write an HF checkpoint directory atomically; return its path.

    ``tensors`` is consumed lazily; at most one shard's worth of arrays is held at a time.
    ``copy_files_from`` copies tokenizer and generation files through (``PASSTHROUGH_FILES``);
    ``extra_json`` writes further JSON files (e.g. ``hf_quant_config.json``).
    ``on_shard(path, sha256_hex, tensor_sha256)`` is called as soon as each shard file is
    complete, in order, with its temporary name (shard ``i`` is renamed
    ``model-{i+1:05d}-of-{n:05d}.safetensors`` at the end), its sha256 and the sha256 of each
    tensor's data, computed while it was written (for manifests).
    """
    path = Path(path)
    with atomic_directory(path, overwrite=overwrite) as tmp:
        shards: list[list[str]] = []
        pending: dict[str, np.ndarray] = {}
        pending_bytes = 0
        total = 0
        seen: set[str] = set()

        def flush() -> None:
            nonlocal pending, pending_bytes
            if pending:
                part = tmp / f"shard-{len(shards):05d}.part"
                hasher = hashlib.sha256() if on_shard is not None else None
                digests: dict[str, str] | None = {} if on_shard is not None else None
                write_file(part, pending, {"format": "pt"}, hasher=hasher, tensor_hashes=digests)
                shards.append(list(pending))
                if on_shard is not None:
                    on_shard(part, hasher.hexdigest(), digests)
                pending, pending_bytes = {}, 0

        for name, arr in tensors:
            if name in seen:
                raise CheckpointError(f"tensor {name!r} written twice")
            seen.add(name)
            arr = np.asarray(arr)
            if pending and pending_bytes + arr.nbytes > max_shard_bytes:
                flush()
            pending[name] = arr
            pending_bytes += arr.nbytes
            total += arr.nbytes
        flush()
        if not shards:
            raise CheckpointError("no tensors to write")

        weight_map = {}
        for i, names in enumerate(shards):
            fname = _shard_name(i + 1, len(shards))
            os.replace(tmp / f"shard-{i:05d}.part", tmp / fname)
            weight_map.update({name: fname for name in names})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG_NAME).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
        for fname, content in (extra_json or {}).items():
            (tmp / fname).write_text(json.dumps(dict(content), indent=2) + "\n")
        if copy_files_from is not None:
            copy_passthrough_files(copy_files_from, tmp)
    return path


def copy_passthrough_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer/generation files that exist in ``src`` into ``dst``."""
    copied = []
    for fname in PASSTHROUGH_FILES:
        if (Path(src) / fname).exists():
            shutil.copyfile(Path(src) / fname, Path(dst) / fname)
            copied.append(fname)
    return copied


__all__ = [
    "CheckpointError",
    "HFCheckpoint",
    "SafetensorsError",
    "copy_passthrough_files",
    "write_hf_checkpoint",
]
