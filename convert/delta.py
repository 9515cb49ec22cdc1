"""Delta versions: a format directory stored as what changed against the previous version.

One RL step moves few stored values (a bf16 weight changes when the update crosses a rounding
boundary; a quantized code far more rarely), so version v+1 of a format is written as a delta
against version v of the same format. ``vNNNNNNNN/{format}/`` then holds::

    delta.json     {"delta_version": 3, "format", "version", "base", "depth", "piece_bytes",
                    "manifest": <the manifest.json text of the full export>,
                    "base_manifest_sha256": <sha256 of the base's manifest.json bytes>,
                    "files": {rel: {"op": "same" | "xor" | "full", "blob": "blobs/00003.zst",
                                    "tensors": {name: {"changed": n, "sha256": <hex>}}}}}
    blobs/*.zst    one zstd stream per changed file

- ``same``: the file's sha256 equals the base's (config, tokenizer, unchanged shards);
- ``xor``: a safetensors file with the base's exact header and size: per piece of whole elements,
  the indices of the changed elements (as gaps) and their XOR against the base, in byte planes,
  then zstd with its checksum (``convert.delta_codec``). Weights and scales alike;
- ``full``: any other changed file, zstd-compressed whole.

``tensors`` (``xor`` entries, version 3) lists every tensor of the file with changed elements:
how many, and the sha256 of its changes (``convert.delta_codec.ChangeDigest``: each changed
element's index and new bytes). With ``base_manifest_sha256`` naming the exact base, a sampler
can apply a delta straight into the weights it serves and verify only what changed
(``sampler_torch.engine.reload_delta``), never materializing the version. ``delta_version`` 2
(the same without these records) is still read and materialized; 1 (a bitmask of the changed
elements instead of their indices) is refused by name, and a sampler holding such a chain falls
back to the newest full snapshot.

``manifest`` is the full export's ``manifest.json`` text verbatim, so the materialized directory
is byte-identical to a full publish of the same weights and a sampler verifies the files it will
load (every sha256 after materialization), not the delta. ``depth`` counts deltas since the last
full snapshot (the publisher writes a full one every ``full_every`` versions).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from convert.delta_codec import (
    MAX_PIECE_BYTES,
    PIECE_BYTES,
    ChangeDigest,
    DeltaError,
    Digest,
    decompress_file,
    encode_piece,
    layout,
    pieces,
    read_exact,
    region_names,
    sha256_of,
    xor_file,
)
from convert.formats.numerics import parallel_map
from convert.manifest import MANIFEST_NAME, ManifestError, check_relative, read_manifest
from convert.store import Store, version_dirname

__all__ = ["DELTA_NAME", "DeltaError", "apply_chain", "apply_delta", "delta_hint", "encode_delta",
           "materialize"]

DELTA_NAME = "delta.json"
DELTA_VERSION = 3
READ_VERSIONS = (2, 3)
_LEVEL = 3


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise DeltaError("delta versions need the zstandard package: pip install zstandard") from None
    return zstandard


# --------------------------------------------------------------------------- encode


def _file_sha(manifest: dict, rel: str) -> str | None:
    entry = manifest.get("files", {}).get(rel)
    return entry.get("sha256") if isinstance(entry, dict) else None


def encode_delta(new_dir: str | os.PathLike, base_dir: str | os.PathLike, out_dir: str | os.PathLike,
                 *, version: int, base_version: int, depth: int = 1) -> int:
    """Write the delta taking ``base_dir`` to ``new_dir`` (two full exports of one format) into
    the empty or new ``out_dir``; return the bytes written."""
    zstd = _zstd()
    new_dir, base_dir, out_dir = Path(new_dir), Path(base_dir), Path(out_dir)
    manifest_text = (new_dir / MANIFEST_NAME).read_text()
    new_manifest = json.loads(manifest_text)
    try:
        base_bytes = (base_dir / MANIFEST_NAME).read_bytes()
        base_manifest = json.loads(base_bytes)
    except (OSError, ValueError):
        base_bytes, base_manifest = None, {}
    (out_dir / "blobs").mkdir(parents=True, exist_ok=True)
    cctx = zstd.ZstdCompressor(level=_LEVEL, write_checksum=True)
    files: dict[str, dict] = {}
    for i, rel in enumerate(sorted(new_manifest["files"])):
        sha = _file_sha(new_manifest, rel)
        base = base_dir / rel
        if sha is not None and sha == _file_sha(base_manifest, rel) and base.is_file():
            files[rel] = {"op": "same"}
            continue
        blob = f"blobs/{i:05d}.zst"
        new_layout = layout(new_dir / rel)
        base_layout = layout(base) if base.is_file() else None
        xor = (new_layout is not None and new_layout == base_layout
               and base.stat().st_size == (new_dir / rel).stat().st_size)
        changed: dict[str, dict] = {}
        with open(out_dir / blob, "wb") as out, cctx.stream_writer(out, closefd=False) as w:
            if xor:
                names = region_names(new_layout[0])
                with open(new_dir / rel, "rb") as fn, open(base, "rb") as fb:
                    for begin, end, size in new_layout[1]:
                        name = names.get(begin)
                        digest = ChangeDigest() if name is not None else None
                        for off, n, k in pieces([(begin, end, size)], PIECE_BYTES):
                            fn.seek(off)
                            fb.seek(off)
                            w.write(encode_piece(np.frombuffer(read_exact(fn, n, rel), np.uint8),
                                                 np.frombuffer(read_exact(fb, n, rel), np.uint8), k,
                                                 digest, (off - begin) // k))
                        if digest is not None and digest.count:
                            changed[name] = {"changed": digest.count, "sha256": digest.hexdigest()}
            else:
                with open(new_dir / rel, "rb") as fn:
                    shutil.copyfileobj(fn, w, PIECE_BYTES)
        files[rel] = {"op": "xor" if xor else "full", "blob": blob,
                      **({"tensors": changed} if xor else {})}
    meta = {"delta_version": DELTA_VERSION, "format": new_manifest.get("format"), "version": version,
            "base": base_version, "depth": depth, "piece_bytes": PIECE_BYTES,
            "manifest": manifest_text,
            "base_manifest_sha256": None if base_bytes is None else hashlib.sha256(base_bytes).hexdigest(),
            "files": files}
    (out_dir / DELTA_NAME).write_text(json.dumps(meta, indent=1) + "\n")
    return sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- apply


def parse_delta(text: str, where: str) -> dict:
    """The checked contents of a ``delta.json``; ``DeltaError`` naming ``where`` otherwise."""
    try:
        meta = json.loads(text)
        got = meta.get("delta_version")
        if got == 1:
            raise ValueError("delta_version 1 (the bitmask encoding of older mixrl) is no longer read; "
                             f"this reader takes {list(READ_VERSIONS)}: materialize from a full snapshot")
        if got not in READ_VERSIONS:
            raise ValueError(f"delta_version {got!r}, expected one of {list(READ_VERSIONS)}")
        int(meta["version"]), int(meta["base"]), int(meta["depth"])
        if not 1 <= int(meta["piece_bytes"]) <= MAX_PIECE_BYTES:
            raise ValueError(f"piece_bytes {meta['piece_bytes']} out of range")
        manifest = json.loads(meta["manifest"])
        for rel, entry in meta["files"].items():
            check_relative(rel)
            if entry["op"] not in ("same", "xor", "full") or rel not in manifest["files"]:
                raise ValueError(f"bad entry for {rel!r}")
            if entry["op"] != "same":
                check_relative(entry["blob"])
            for name, rec in entry.get("tensors", {}).items():
                if not (isinstance(name, str) and int(rec["changed"]) > 0
                        and isinstance(rec["sha256"], str)):
                    raise ValueError(f"bad change record of {name!r} in {rel!r}")
        base_sha = meta.get("base_manifest_sha256")
        if base_sha is not None and not isinstance(base_sha, str):
            raise ValueError("base_manifest_sha256 is not a hex string")
    except (ValueError, KeyError, TypeError, AttributeError, ManifestError) as e:
        raise DeltaError(f"{where}: malformed {DELTA_NAME} ({e})") from None
    return meta


def _read_delta(delta_dir: Path) -> dict:
    try:
        return parse_delta((delta_dir / DELTA_NAME).read_text(), str(delta_dir))
    except OSError as e:
        raise DeltaError(f"{delta_dir}: cannot read {DELTA_NAME} ({e.strerror})") from None


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)  # files are never written in place, so sharing an inode is safe
    except OSError:
        shutil.copyfile(src, dst)


def _apply_file(zstd, rel: str, steps: list[tuple[Path, dict, dict | None]], base_dir: Path,
                out_dir: Path) -> Digest:
    """Write ``out_dir/rel`` from ``base_dir/rel`` and its entries in each delta of a chain
    (``(delta dir, delta.json, entry or None where that version lacks the file)``, oldest
    first), reading the base and writing the result once; return its ``(size, sha256)``."""
    dest = out_dir / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A step that is not built on the previous version's file (stored whole, or absent) resets it.
    reset = max((i for i, (_, _, e) in enumerate(steps) if e is None or e["op"] == "full"), default=-1)
    if reset >= 0 and steps[reset][2] is None:
        raise DeltaError(f"{steps[reset][0]}: {rel} is absent, yet a later delta builds on it")
    xors = [(d / e["blob"], int(m["piece_bytes"])) for d, m, e in steps[reset + 1:] if e["op"] == "xor"]
    if reset >= 0:
        d, m, e = steps[reset]
        digest = decompress_file(zstd, d / e["blob"], dest, int(m["piece_bytes"]))
        if not xors:
            return digest
        base = dest.with_name(dest.name + ".base")
        os.replace(dest, base)
    else:
        base = base_dir / rel
        if not base.is_file():
            raise DeltaError(f"{steps[0][0]}: base file {rel} is missing from {base_dir}")
        if not xors:
            _link_or_copy(base, dest)
            return sha256_of(dest)
    if len({p for _, p in xors}) > 1:
        raise DeltaError(f"{rel}: the deltas of this chain were cut into different pieces")
    try:
        return xor_file(zstd, base, [b for b, _ in xors], dest, xors[0][1])
    finally:
        if reset >= 0:
            base.unlink(missing_ok=True)


def apply_chain(delta_dirs: Sequence[str | os.PathLike], base_dir: str | os.PathLike,
                out_dir: str | os.PathLike) -> dict[str, Digest]:
    """Write the full directory of the last of ``delta_dirs`` (a chain, oldest first, the first
    made against ``base_dir``) into the new ``out_dir``; return ``{relative path: (size,
    sha256)}`` of the files written (``manifest.json`` aside).

    Each file is written once, hashed as it is written, however long the chain (no
    intermediate version is materialized). The base is only read. Raises ``DeltaError`` on a
    missing base file, a corrupt or truncated blob; the digests are not compared with the
    manifest here (``materialize`` does).
    """
    zstd = _zstd()
    dirs = [Path(d) for d in delta_dirs]
    if not dirs:
        raise ValueError("apply_chain needs at least one delta")
    metas = [_read_delta(d) for d in dirs]
    for i in range(1, len(dirs)):
        if int(metas[i]["base"]) != int(metas[i - 1]["version"]):
            raise DeltaError(f"{dirs[i]}: built on version {metas[i]['base']}, not {metas[i - 1]['version']}")
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    out_dir.mkdir(parents=True)
    files = sorted(metas[-1]["files"], key=lambda rel: -(base_dir / rel).stat().st_size
                   if (base_dir / rel).is_file() else 0)  # largest first: they bound the time
    def one(rel: str) -> Digest:
        steps = [(d, m, m["files"].get(rel)) for d, m in zip(dirs, metas, strict=True)]
        return _apply_file(zstd, rel, steps, base_dir, out_dir)

    digests = parallel_map(one, files)
    (out_dir / MANIFEST_NAME).write_text(metas[-1]["manifest"])
    return dict(zip(files, digests, strict=True))


def apply_delta(delta_dir: str | os.PathLike, base_dir: str | os.PathLike,
                out_dir: str | os.PathLike) -> dict:
    """``apply_chain`` of one delta; return the manifest (the files are not verified here)."""
    apply_chain([delta_dir], base_dir, out_dir)
    return json.loads((Path(out_dir) / MANIFEST_NAME).read_text())


def _problems(out: Path, manifest: dict, digests: Mapping[str, Digest],
              expect: Mapping[str, Digest] | None) -> list[str]:
    """Differences between the files written to ``out`` (their digests as written) and the
    manifest, and ``expect`` (what the trainer announced) if given; each names the file."""
    problems = [f"{out / rel}: not listed in {MANIFEST_NAME}" for rel in digests
                if rel not in manifest["files"] and rel != MANIFEST_NAME]
    wanted = [(MANIFEST_NAME, {rel: (e["size"], e["sha256"]) for rel, e in manifest["files"].items()})]
    if expect is not None:
        wanted.append(("the announced manifest", dict(expect)))
    for name, files in wanted:
        for rel, (size, sha) in files.items():
            got = digests.get(rel)
            if got is None:
                problems.append(f"{out / rel}: listed in {name} but missing")
            elif got[0] != size or (out / rel).stat().st_size != size:
                problems.append(f"{out / rel}: size {got[0]} bytes, {name} says {size} "
                                "(truncated or replaced)")
            elif got[1] != sha:
                problems.append(f"{out / rel}: sha256 {got[1][:16]}... does not match {name} "
                                f"({sha[:16]}...); corrupt")
    return problems


# --------------------------------------------------------------------------- chains


def read_step(store: Store, version: int, fmt: str) -> dict | None:
    """The parsed ``delta.json`` of ``version``/``fmt``; ``None`` if it is a full snapshot;
    ``DeltaError`` if the store has neither (a gap)."""
    rel = f"{version_dirname(version)}/{fmt}"
    text = store.read_text(f"{rel}/{DELTA_NAME}")
    if text is not None:
        return parse_delta(text, f"{store.root}/{rel}")
    if store.exists(f"{rel}/{MANIFEST_NAME}"):
        return None
    raise DeltaError(f"{store.root}: version {version} has no {fmt} weights (a gap in the chain)")


def chain(store: Store, version: int, fmt: str, have: int | None = None) -> tuple[int, list[int]]:
    """``(start, deltas)``: the version to start from (``have`` when the chain reaches it, else
    the newest full snapshot at or before ``version``) and the delta versions to apply, in order."""
    steps, k = [], version
    while True:
        if have is not None and k == have:
            return k, steps[::-1]
        meta = read_step(store, k, fmt)
        if meta is None:
            return k, steps[::-1]
        steps.append(k)
        if int(meta["base"]) >= k:
            raise DeltaError(f"{store.root}: version {k} {fmt} names base {meta['base']}")
        k = int(meta["base"])


class ChainSource(Protocol):
    """Where the stored versions of a chain come from: a store, or a trainer over gRPC."""

    name: str

    def chain(self, version: int, fmt: str, have: int | None) -> tuple[int, list[int]]:
        """``(start, deltas)`` as ``chain`` below."""

    def local_dir(self, version: int, fmt: str, work: Path) -> Path:
        """A local directory holding ``version``'s stored files (fetched into ``work`` if need be)."""


class StoreSource:
    """A ``ChainSource`` reading a ``Store`` (a local store's files are read in place)."""

    def __init__(self, store: Store):
        self.store, self.name = store, store.root

    def chain(self, version: int, fmt: str, have: int | None) -> tuple[int, list[int]]:
        return chain(self.store, version, fmt, have)

    def local_dir(self, version: int, fmt: str, work: Path) -> Path:
        rel = f"{version_dirname(version)}/{fmt}"
        if self.store.local is not None:
            return self.store.local / rel
        dest = work / f"stored-{version}"
        self.store.get_dir(rel, dest)
        return dest


def materialize(source: Store | ChainSource, version: int, fmt: str, out: str | os.PathLike, *,
                have: tuple[int, str | os.PathLike] | None = None,
                expect: Mapping[str, Digest] | None = None,
                log: Callable[[str], None] | None = None) -> str:
    """Write the full ``fmt`` directory of ``version`` to the new ``out``, verified; return how.

    ``source``: a ``Store`` or another ``ChainSource``. ``have``: ``(version, directory)`` of
    this format already held (a sampler's current weights): the chain is applied from it when it
    reaches it. Every file must match the version's manifest, and ``expect`` (``{relative path:
    (size, sha256)}``, e.g. what the trainer announced) if given; the digests are taken as the
    files are written, so verifying costs no second read. Any failure along the ``have`` path (a
    gap, a corrupt or truncated delta, a hash mismatch) falls back to the newest full snapshot;
    ``DeltaError`` only when that fails too. ``out`` appears complete or not at all; ``have``'s
    directory is only read.
    """
    if isinstance(source, Store):
        source = StoreSource(source)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if have is not None:
        try:
            return _materialize(source, version, fmt, out, have, expect)
        except Exception as e:  # noqa: BLE001 - any failure from what we hold: try the snapshot
            if log is not None:
                log(f"delta from v{have[0]} failed ({e}); falling back to the full snapshot")
    return _materialize(source, version, fmt, out, None, expect)


def _materialize(source: ChainSource, version: int, fmt: str, out: Path,
                 have: tuple[int, str | os.PathLike] | None, expect: Mapping[str, Digest] | None) -> str:
    start, deltas = source.chain(version, fmt, None if have is None else have[0])
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.materialize-", dir=out.parent))
    try:
        if have is not None and start == have[0]:
            current, how = Path(have[1]), f"v{start} held + {len(deltas)} delta(s)"
        else:
            current = source.local_dir(start, fmt, work)
            how = f"full snapshot v{start} + {len(deltas)} delta(s)"
        result = work / "result"
        if deltas:
            digests = apply_chain([source.local_dir(k, fmt, work) for k in deltas], current, result)
        else:  # no delta to apply: link the snapshot's files so the result is ours to rename
            rels = [p.relative_to(current).as_posix() for p in sorted(current.rglob("*"))
                    if p.is_file() and p.name != MANIFEST_NAME]
            for rel in [*rels, MANIFEST_NAME]:
                if (current / rel).is_file():
                    _link_or_copy(current / rel, result / rel)
            digests = dict(zip(rels, parallel_map(lambda rel: sha256_of(result / rel), rels), strict=True))
        if (result / MANIFEST_NAME).is_file():  # an announced manifest may list manifest.json
            digests[MANIFEST_NAME] = sha256_of(result / MANIFEST_NAME)
        try:
            problems = _problems(result, read_manifest(result), digests, expect)
        except ManifestError as e:
            problems = [str(e)]
        if problems:
            raise DeltaError(f"v{version} {fmt} after {how}: " + "; ".join(problems[:3]))
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(out)
        os.replace(result, out)
        return how
    finally:
        shutil.rmtree(work, ignore_errors=True)


def delta_hint(model_dir: str | os.PathLike) -> str | None:
    """What to do with a published delta version given where a full HF directory belongs (a
    sampler's ``--model-dir``, ``mixrl-train serve --weights-dir``): one sentence naming
    ``mixrl-convert materialize`` with the arguments that write it out in full; None for anything
    else. ``model_dir`` may be the format directory (``weights/v00000003/fp8``) or the version
    directory above it."""
    root = Path(model_dir)
    subdirs = sorted(p for p in root.glob("*") if p.is_dir())
    found = [d for d in (root, *subdirs) if (d / DELTA_NAME).is_file()]
    if not found:
        return None
    d = found[0]
    try:
        meta = json.loads((d / DELTA_NAME).read_text())
        version, fmt, base = int(meta["version"]), str(meta["format"]), meta.get("base", "?")
    except (OSError, ValueError, KeyError, TypeError):  # a damaged delta.json: name the command alone
        return (f"{model_dir} is a delta version (it holds {DELTA_NAME}, not a full HF directory); "
                "write one with mixrl-convert materialize --root ROOT --version V --format F --out DIR")
    publish_root = d.parent.parent
    return (f"{model_dir} is a delta version (v{version} of {fmt}, stored as changes against v{base}), "
            f"not a full HF directory; write one with mixrl-convert materialize --root {publish_root} "
            f"--version {version} --format {fmt} --out DIR")
