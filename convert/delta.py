"""Delta versions: a format directory stored as what changed against the previous version.

One RL step moves few stored values (a bf16 weight changes when the update crosses a rounding
boundary; a quantized code far more rarely), so version v+1 of a format is written as a delta
against version v of the same format. ``vNNNNNNNN/{format}/`` then holds::

    delta.json     {"delta_version": 1, "format", "version", "base", "depth",
                    "manifest": <the manifest.json text of the full export>,
                    "files": {rel: {"op": "same" | "xor" | "full", "blob": "blobs/00003.zst"}}}
    blobs/*.zst    one zstd stream per changed file

- ``same``: the file's sha256 equals the base's (config, tokenizer, unchanged shards);
- ``xor``: a safetensors file with the base's exact header and size: per tensor (in pieces of
  whole elements), a bitmask of the elements whose bytes changed, then the XOR of those elements
  against the base in byte planes (byte 0 of each, then byte 1, ...; the high bytes of a small
  change are zero), then zstd (with its checksum, so a corrupt blob is refused while decoding).
  Weights and scales alike, element by element;
- ``full``: any other changed file, zstd-compressed whole.

``manifest`` is the full export's ``manifest.json`` text verbatim, so the materialized directory
is byte-identical to a full publish of the same weights and a sampler verifies the files it will
load (every sha256 after materialization), not the delta. ``depth`` counts deltas since the last
full snapshot (the publisher writes a full one every ``full_every`` versions).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from convert.manifest import MANIFEST_NAME, ManifestError, check_manifest, check_relative
from convert.safetensors_io import DTYPES, MAX_HEADER_BYTES
from convert.store import Store, version_dirname

DELTA_NAME = "delta.json"
DELTA_VERSION = 1
_CHUNK = 16 * 1024 * 1024  # bytes of one tensor handled at a time (bounded memory)
_LEVEL = 3


class DeltaError(RuntimeError):
    """A delta cannot be applied: a gap in the chain, a corrupt or truncated blob, a bad base."""


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise DeltaError("delta versions need the zstandard package: pip install zstandard") from None
    return zstandard


# --------------------------------------------------------------------------- safetensors layout


def _layout(path: Path) -> tuple[bytes, list[tuple[int, int, int]]] | None:
    """``(header bytes, [(begin, end, itemsize)])`` covering the data of a safetensors file in
    file order (absolute offsets); ``None`` if the file is not one."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return None
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                return None
            head = f.read(n)
        header = json.loads(head)
        start = 8 + n
        spans = sorted((int(e["data_offsets"][0]), int(e["data_offsets"][1]),
                        DTYPES[e["dtype"]].itemsize)
                       for k, e in header.items() if k != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    regions, pos = [], start
    for begin, end, k in spans:
        begin, end = begin + start, end + start
        if begin < pos or end > size:
            return None  # overlapping or out of range: not a layout we can split safely
        if begin > pos:
            regions.append((pos, begin, 1))
        if (end - begin) % k:
            k = 1
        regions.append((begin, end, k))
        pos = end
    if pos < size:
        regions.append((pos, size, 1))
    return raw + head, regions


def _pieces(regions: list[tuple[int, int, int]]):
    """``(offset, nbytes, itemsize)`` pieces of at most ~``_CHUNK`` bytes, whole elements each."""
    for begin, end, k in regions:
        step = max(k, _CHUNK - _CHUNK % k)
        for off in range(begin, end, step):
            yield off, min(step, end - off), k


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _encode_piece(x: np.ndarray, k: int) -> bytes:
    """The XOR bytes ``x`` of ``len(x) // k`` elements as a bitmask of the changed elements
    followed by their XOR values in byte planes: a few % of elements change, and the mask of
    those (1 bit each) plus their values compresses ~1.5x better than the zero runs would."""
    e = x.view(_UINT[k]) if k in _UINT else x
    k = k if k in _UINT else 1
    nz = e != 0
    vals = e[nz].view(np.uint8)
    planes = vals if k == 1 else vals.reshape(-1, k).T
    return np.packbits(nz).tobytes() + np.ascontiguousarray(planes).tobytes()


def _decode_piece(stream, n: int, k: int, what: str) -> np.ndarray:
    """The ``n`` XOR bytes written by ``_encode_piece``, read from ``stream``."""
    k = k if k in _UINT else 1
    nel = n // k
    nz = np.unpackbits(_read_exact(stream, (nel + 7) // 8, what), count=nel).view(bool)
    nnz = int(np.count_nonzero(nz))
    vals = _read_exact(stream, nnz * k, what)
    out = np.zeros(nel, _UINT[k])
    if nnz:
        out[nz] = (vals if k == 1 else np.ascontiguousarray(vals.reshape(k, -1).T)).reshape(-1).view(_UINT[k])
    return out.view(np.uint8)


def _read_exact(f, n: int, what: str) -> np.ndarray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            raise DeltaError(f"{what}: truncated ({got} of {n} bytes)")
        view[got:got + len(chunk)] = chunk
        got += len(chunk)
    return np.frombuffer(buf, np.uint8)


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
        base_manifest = json.loads((base_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        base_manifest = {}
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
        new_layout = _layout(new_dir / rel)
        base_layout = _layout(base) if base.is_file() else None
        xor = (new_layout is not None and new_layout == base_layout
               and base.stat().st_size == (new_dir / rel).stat().st_size)
        with open(out_dir / blob, "wb") as out, cctx.stream_writer(out, closefd=False) as w:
            if xor:
                with open(new_dir / rel, "rb") as fn, open(base, "rb") as fb:
                    for off, n, k in _pieces(new_layout[1]):
                        fn.seek(off)
                        fb.seek(off)
                        w.write(_encode_piece(_read_exact(fn, n, rel) ^ _read_exact(fb, n, rel), k))
            else:
                with open(new_dir / rel, "rb") as fn:
                    shutil.copyfileobj(fn, w, _CHUNK)
        files[rel] = {"op": "xor" if xor else "full", "blob": blob}
    meta = {"delta_version": DELTA_VERSION, "format": new_manifest.get("format"), "version": version,
            "base": base_version, "depth": depth, "manifest": manifest_text, "files": files}
    (out_dir / DELTA_NAME).write_text(json.dumps(meta, indent=1) + "\n")
    return sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- apply


def parse_delta(text: str, where: str) -> dict:
    """The checked contents of a ``delta.json``; ``DeltaError`` naming ``where`` otherwise."""
    try:
        meta = json.loads(text)
        if meta.get("delta_version") != DELTA_VERSION:
            raise ValueError(f"delta_version {meta.get('delta_version')!r}, expected {DELTA_VERSION}")
        int(meta["base"]), int(meta["depth"])
        manifest = json.loads(meta["manifest"])
        for rel, entry in meta["files"].items():
            check_relative(rel)
            if entry["op"] not in ("same", "xor", "full") or rel not in manifest["files"]:
                raise ValueError(f"bad entry for {rel!r}")
            if entry["op"] != "same":
                check_relative(entry["blob"])
    except (ValueError, KeyError, TypeError, AttributeError, ManifestError) as e:
        raise DeltaError(f"{where}: malformed {DELTA_NAME} ({e})") from None
    return meta


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)  # files are never written in place, so sharing an inode is safe
    except OSError:
        shutil.copyfile(src, dst)


def apply_delta(delta_dir: str | os.PathLike, base_dir: str | os.PathLike,
                out_dir: str | os.PathLike) -> dict:
    """Write the full directory of a delta version into the new ``out_dir``; return its manifest.

    The base is only read. Raises ``DeltaError`` on a missing base file, a corrupt or truncated
    blob; the result is not verified here (``materialize`` checks the manifest at the end).
    """
    zstd = _zstd()
    delta_dir, base_dir, out_dir = Path(delta_dir), Path(base_dir), Path(out_dir)
    try:
        meta = parse_delta((delta_dir / DELTA_NAME).read_text(), str(delta_dir))
    except OSError as e:
        raise DeltaError(f"{delta_dir}: cannot read {DELTA_NAME} ({e.strerror})") from None
    out_dir.mkdir(parents=True)
    dctx = zstd.ZstdDecompressor()
    for rel, entry in sorted(meta["files"].items()):
        base, dest = base_dir / rel, out_dir / rel
        if entry["op"] != "full" and not base.is_file():
            raise DeltaError(f"{delta_dir}: base file {rel} is missing from {base_dir}")
        if entry["op"] == "same":
            _link_or_copy(base, dest)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        blob = str(delta_dir / entry["blob"])
        try:
            with open(delta_dir / entry["blob"], "rb") as fz, dctx.stream_reader(fz) as r, \
                    open(dest, "wb") as out:
                if entry["op"] == "full":
                    shutil.copyfileobj(r, out, _CHUNK)
                    continue
                layout = _layout(base)
                if layout is None:
                    raise DeltaError(f"{delta_dir}: base file {rel} is not a safetensors file")
                out.write(layout[0])
                with open(base, "rb") as fb:
                    for off, n, k in _pieces(layout[1]):
                        fb.seek(off)
                        x = _decode_piece(r, n, k, blob)
                        out.write((x ^ _read_exact(fb, n, str(base))).data)
                if r.read(1):
                    raise DeltaError(f"{delta_dir / entry['blob']}: longer than its base file")
        except (zstd.ZstdError, OSError) as e:
            raise DeltaError(f"{delta_dir / entry['blob']}: corrupt or truncated ({e})") from None
    (out_dir / MANIFEST_NAME).write_text(meta["manifest"])
    return json.loads(meta["manifest"])


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
                log: Callable[[str], None] | None = None) -> str:
    """Write the full ``fmt`` directory of ``version`` to the new ``out``, verified; return how.

    ``source``: a ``Store`` or another ``ChainSource``. ``have``: ``(version, directory)`` of
    this format already held (a sampler's current weights): the chain is applied from it when it
    reaches it. Any failure along that path (a gap, a corrupt or truncated delta, a hash
    mismatch) falls back to the newest full snapshot; ``DeltaError`` only when that fails too.
    ``out`` appears complete or not at all; ``have``'s directory is only read.
    """
    if isinstance(source, Store):
        source = StoreSource(source)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if have is not None:
        try:
            return _materialize(source, version, fmt, out, have)
        except Exception as e:  # noqa: BLE001 - any failure from what we hold: try the snapshot
            if log is not None:
                log(f"delta from v{have[0]} failed ({e}); falling back to the full snapshot")
    return _materialize(source, version, fmt, out, None)


def _materialize(source: ChainSource, version: int, fmt: str, out: Path,
                 have: tuple[int, str | os.PathLike] | None) -> str:
    start, deltas = source.chain(version, fmt, None if have is None else have[0])
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.materialize-", dir=out.parent))
    try:
        if have is not None and start == have[0]:
            current, how = Path(have[1]), f"v{start} held + {len(deltas)} delta(s)"
        else:
            current = source.local_dir(start, fmt, work)
            how = f"full snapshot v{start} + {len(deltas)} delta(s)"
        for k in deltas:
            delta_dir = source.local_dir(k, fmt, work)
            nxt = work / f"v{k}"
            apply_delta(delta_dir, current, nxt)
            for done in (current, delta_dir):
                if done.is_relative_to(work):
                    shutil.rmtree(done, ignore_errors=True)
            current = nxt
        result = work / "result"
        if current.is_relative_to(work):
            os.replace(current, result)
        else:  # no delta to apply: link the snapshot's files so the result is ours to rename
            for p in current.rglob("*"):
                if p.is_file():
                    _link_or_copy(p, result / p.relative_to(current))
        problems = check_manifest(result)
        if problems:
            raise DeltaError(f"v{version} {fmt} after {how}: " + "; ".join(problems[:3]))
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(out)
        os.replace(result, out)
        return how
    finally:
        shutil.rmtree(work, ignore_errors=True)
