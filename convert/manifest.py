"""``manifest.json``: the sha256 and size of every file of an exported weight directory, and the
sha256 of every tensor of its safetensors files.

Written last, inside the temp directory, so a directory that has one is complete. A sampler
checks it before swapping weights (``check_manifest``); any difference means the directory
must not be loaded. Layout::

    {"manifest_version": 2, "format": "fp8_block", ...metadata...,
     "files": {"config.json": {"sha256": "<hex>", "size": 1234},
               "model-00001-of-00001.safetensors": {"sha256": "<hex>", "size": 5678,
                                                    "tensors": {"<name>": "<hex>", ...}}, ...}}

Paths are relative to the directory, with ``/`` separators; ``manifest.json`` itself is not
listed. ``tensors`` (version 2) holds, for each tensor of a safetensors file, the sha256 of its
data bytes as stored (``convert.safetensors_io.tensor_sha256``): a sampler that applies a new
version into the weights it serves reads and verifies only the tensors whose digest changed
(``sampler_torch.engine.reload``). Version 1 manifests (no ``tensors``) stay readable: their
files are verified whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from convert.formats.numerics import parallel_map
from convert.safetensors_io import SafetensorsError, tensor_sha256

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 2
_CHUNK = 8 * 1024 * 1024


class ManifestError(ValueError):
    """A manifest is missing or malformed, or the files disagree with it."""


def sha256_file(path: str | os.PathLike | int) -> str:
    """sha256 of a file, by path or by an open file descriptor (which it closes)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])  # hashlib drops the GIL for large updates: files hash in parallel
    return h.hexdigest()


def _listed_files(root: Path) -> list[str]:
    files = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST_NAME:
            files.append(p.relative_to(root).as_posix())
    return files


def _tensor_digests(path: Path) -> dict[str, str] | None:
    """Per-tensor digests of a ``*.safetensors`` file; ``None`` for any other file (or one that
    does not parse: it is listed by its file digest alone)."""
    if not path.name.endswith(".safetensors"):
        return None
    try:
        return tensor_sha256(path)
    except (SafetensorsError, OSError):
        return None


def build_manifest(root: str | os.PathLike, *, known: Mapping[str, str] | None = None,
                   known_tensors: Mapping[str, Mapping[str, str]] | None = None,
                   **metadata) -> dict:
    """Hash every file under ``root`` (in parallel) and return the manifest dict.

    ``known`` maps relative paths to sha256 digests already computed (e.g. while the files
    were written); those files are not read again. ``known_tensors`` maps relative paths of
    safetensors files to their per-tensor digests, likewise.
    """
    root = Path(root)
    files = _listed_files(root)
    known = dict(known or {})
    tensors = {rel: dict(d) for rel, d in (known_tensors or {}).items()}
    missing = sorted((set(known) | set(tensors)) - set(files))
    if missing:
        raise ManifestError(f"{root}: precomputed digests for files that do not exist: {missing}")
    todo = [rel for rel in files if rel not in known]
    known.update(zip(todo, parallel_map(lambda rel: sha256_file(root / rel), todo), strict=True))
    todo = [rel for rel in files if rel not in tensors]
    tensors.update(zip(todo, parallel_map(lambda rel: _tensor_digests(root / rel), todo), strict=True))
    manifest: dict = {"manifest_version": MANIFEST_VERSION, **metadata}
    manifest["files"] = {rel: {"sha256": known[rel], "size": (root / rel).stat().st_size,
                               **({"tensors": tensors[rel]} if tensors[rel] is not None else {})}
                         for rel in files}
    return manifest


def write_manifest(root: str | os.PathLike, *, known: Mapping[str, str] | None = None,
                   known_tensors: Mapping[str, Mapping[str, str]] | None = None,
                   **metadata) -> dict:
    """Write ``root/manifest.json`` describing every other file under ``root``."""
    manifest = build_manifest(root, known=known, known_tensors=known_tensors, **metadata)
    (Path(root) / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def read_manifest(root: str | os.PathLike) -> dict:
    path = Path(root) / MANIFEST_NAME
    if not path.exists():
        raise ManifestError(f"{path}: missing (an export is complete only with its manifest)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, Mapping):
            raise TypeError("files is not an object")
        for rel, entry in files.items():
            if not isinstance(entry, Mapping) or not {"sha256", "size"} <= set(entry):
                raise TypeError(f"entry for {rel!r} lacks sha256/size")
            digests = entry.get("tensors", {})
            if not isinstance(digests, Mapping) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in digests.items()):
                raise TypeError(f"tensors of {rel!r} is not a name -> sha256 object")
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: malformed ({e})") from None
    return manifest


def tensor_digests(manifest: Mapping) -> dict[str, tuple[str, str]] | None:
    """``{tensor name: (relative path of its file, sha256 of its data)}`` from a version-2
    manifest; ``None`` when a safetensors file lacks per-tensor digests (a version-1 manifest:
    only whole files can be verified)."""
    out: dict[str, tuple[str, str]] = {}
    for rel, entry in manifest["files"].items():
        if not rel.endswith(".safetensors"):
            continue
        if "tensors" not in entry:
            return None
        out.update({name: (rel, sha) for name, sha in entry["tensors"].items()})
    return out


def check_manifest(root: str | os.PathLike, *, hashes: bool = True) -> list[str]:
    """Problems with ``root`` against its manifest, each naming the file; empty if all match.

    Sizes are compared first (a truncated shard is caught without hashing); ``hashes`` then
    re-hashes every file.
    """
    root = Path(root)
    try:
        manifest = read_manifest(root)
    except ManifestError as e:
        return [str(e)]
    problems = []
    listed = manifest["files"]
    for rel in _listed_files(root):
        if rel not in listed:
            problems.append(f"{root / rel}: not listed in {MANIFEST_NAME}")
    to_hash = []
    for rel, entry in listed.items():
        path = root / rel
        if not path.is_file():
            problems.append(f"{path}: listed in {MANIFEST_NAME} but missing")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            problems.append(f"{path}: size {size} bytes, {MANIFEST_NAME} says {entry['size']} "
                            "(truncated or replaced)")
            continue
        to_hash.append(rel)
    if hashes:
        digests = parallel_map(lambda rel: sha256_file(root / rel), to_hash)
        for rel, digest in zip(to_hash, digests, strict=True):
            if digest != listed[rel]["sha256"]:
                problems.append(f"{root / rel}: sha256 {digest[:16]}... does not match "
                                f"{MANIFEST_NAME} ({listed[rel]['sha256'][:16]}...); corrupt")
    return problems


def check_relative(rel: str) -> None:
    """Raise ``ManifestError`` if manifest path ``rel`` could name a file outside its directory
    (absolute, or through ``..``): a manifest from the network must not pick where we write."""
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts:
        raise ManifestError(f"manifest path {rel!r} escapes the weights directory")


def verify_files(root: str | os.PathLike, files: Mapping[str, tuple[int, str]]) -> list[str]:
    """Problems of ``root`` against ``{relative path: (size, sha256)}``, each naming the file.

    For a manifest that arrived another way than ``root/manifest.json`` (a sampler holds the one
    the trainer published): only the listed files are checked, unlisted extras are allowed. Sizes
    first, so a truncated file is reported without hashing; the rest hash in parallel.
    """
    root = Path(root)
    problems, to_hash = [], []
    for rel, (size, sha) in sorted(files.items()):
        try:
            check_relative(rel)
        except ManifestError as e:
            problems.append(str(e))
            continue
        path = root / rel
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{path}: size {path.stat().st_size} bytes, the manifest says {size}")
        else:
            to_hash.append((rel, sha))
    digests = parallel_map(lambda item: sha256_file(root / item[0]), to_hash)
    for (rel, sha), digest in zip(to_hash, digests, strict=True):
        if digest != sha:
            problems.append(f"{root / rel}: sha256 does not match the manifest (corrupt)")
    return problems
