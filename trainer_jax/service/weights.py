"""Published weight versions: where each format lives, its manifest, and chunked file serving.

``publish`` records version ``v`` as ``{format: directory}`` with a manifest per format: the
converter's ``manifest.json`` when the directory has one (``convert.manifest``), else one computed
here. ``manifest.json`` itself is listed too (hashed at publish time) so a sampler that fetches a
version over gRPC gets a directory the converter's own verification accepts. Only files listed in
a manifest of a retained version can be fetched: the file service is not a path oracle.

A format published as a delta (``convert.delta``) is announced with the manifest of its full
directory (what the sampler verifies and loads) and a chain: the newest full snapshot this
registry serves, then each delta up to the version, with the files as stored. A sampler that
holds a version on the chain fetches only the deltas after it (``FetchWeights`` with
``have_version``); the versions a retained chain needs stay fetchable. The publish root is
announced too, so samplers that can read it (a shared directory, an object store) go there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from convert.delta import DELTA_NAME, parse_delta
from convert.manifest import MANIFEST_NAME, build_manifest, read_manifest, sha256_file
from convert.store import is_url, open_store
from mixrl_wire import pb

CHUNK_BYTES = 1024 * 1024
Files = dict[str, tuple[int, str]]  # {relative path: (size, sha256)}


@dataclasses.dataclass(frozen=True)
class Location:
    """One format of a published version."""

    path: Path | str  # the directory as stored (a URL on an object store)
    files: Files  # what a sampler loads: the full directory's files, after any delta
    base: int = -1  # the version a delta applies to; -1: a full snapshot
    stored: Files | None = None  # the files as stored, when the trainer can serve them
    store: str = ""  # the publish root samplers may read directly


@dataclasses.dataclass(frozen=True)
class PublishedVersion:
    version: int
    locations: dict[str, Location]
    published_unix: float
    chains: dict[str, list[tuple[int, int, Files]]] = dataclasses.field(default_factory=dict)

    def to_pb(self) -> pb.WeightVersion:
        locs = []
        for fmt, loc in self.locations.items():
            chain = [pb.WeightStep(version=v, base=b, stored=_manifest_pb(stored))
                     for v, b, stored in self.chains.get(fmt, [])]
            locs.append(pb.WeightLocation(format=fmt, path=str(loc.path), manifest=_manifest_pb(loc.files),
                                          store=loc.store, chain=chain))
        return pb.WeightVersion(version=self.version, locations=locs,
                                published_unix_ms=int(self.published_unix * 1000))


def _manifest_pb(files: Files) -> pb.Manifest:
    return pb.Manifest(files=[pb.FileDigest(path=rel, size=size, sha256=sha)
                              for rel, (size, sha) in sorted(files.items())])


def _listed(manifest: Mapping) -> Files:
    return {rel: (int(e["size"]), str(e["sha256"])) for rel, e in manifest["files"].items()}


def _with_manifest_text(files: Files, text: str) -> Files:
    # manifest.json is listed too, so a fetched directory is one the converter's checks accept.
    data = text.encode()
    return {**files, MANIFEST_NAME: (len(data), hashlib.sha256(data).hexdigest())}


def manifest_files(path: Path, manifest: Mapping | None = None) -> Files:
    """``{relative path: (size, sha256)}`` of a full weight directory (see module docstring)."""
    if manifest is None:
        manifest = read_manifest(path) if (path / MANIFEST_NAME).exists() else build_manifest(path)
        listed_self = (path / MANIFEST_NAME).exists()
    else:
        listed_self = False
    files = _listed(manifest)
    if listed_self:
        files[MANIFEST_NAME] = ((path / MANIFEST_NAME).stat().st_size, sha256_file(path / MANIFEST_NAME))
    return files


def _store_root(path: str, version: int) -> str:
    """The publish root of ``root/vNNNNNNNN/fmt`` if ``path`` is laid out so, else ''."""
    parts = path.rstrip("/").rsplit("/", 2)
    return parts[0] if len(parts) == 3 and parts[1] == f"v{version:08d}" else ""


def locate(version: int, fmt: str, p: str | os.PathLike, manifest: Mapping | None = None) -> Location:
    """The ``Location`` of one published format: a full directory, a delta, or a URL."""
    if is_url(p):  # an object store: samplers read it directly; nothing to serve from here
        url = str(p).rstrip("/")
        store = open_store(_store_root(url, version) or url)
        rel = url[len(store.root.rstrip("/")):].strip("/")
        text = store.read_text(f"{rel}/{DELTA_NAME}")
        if text is not None:
            meta = parse_delta(text, url)
            return Location(url, _with_manifest_text(_listed(json.loads(meta["manifest"])), meta["manifest"]),
                            int(meta["base"]), None, store.root)
        text = store.read_text(f"{rel}/{MANIFEST_NAME}")
        if text is None:
            raise FileNotFoundError(f"weights for format {fmt!r}: {url} holds no manifest")
        return Location(url, _with_manifest_text(_listed(json.loads(text)), text), -1, None, store.root)
    path = Path(p).resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"weights for format {fmt!r}: {path} is not a directory")
    store = _store_root(path.as_posix(), version)
    if (path / DELTA_NAME).is_file():
        meta = parse_delta((path / DELTA_NAME).read_text(), str(path))
        files = _with_manifest_text(_listed(json.loads(meta["manifest"])), meta["manifest"])
        return Location(path, files, int(meta["base"]), build_manifest_files(path), store)
    files = manifest_files(path, manifest)
    return Location(path, files, -1, files, store)


def build_manifest_files(path: Path) -> Files:
    """Size and sha256 of every file under ``path`` (a delta's stored files: small)."""
    return _listed(build_manifest(path))


class WeightRegistry:
    """Thread-safe record of published versions; watchers wait on ``wait_newer``."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._cond = threading.Condition()
        self._versions: dict[int, PublishedVersion] = {}
        self._closed = False

    def publish(self, version: int, paths: Mapping[str, str | os.PathLike],
                manifests: Mapping[str, Mapping] | None = None) -> PublishedVersion:
        if not paths:
            raise ValueError("publish needs at least one {format: directory}")
        locations = {fmt: locate(version, fmt, p, (manifests or {}).get(fmt)) for fmt, p in paths.items()}
        with self._cond:
            latest = self.latest_locked()
            if latest is not None and version <= latest.version:
                raise ValueError(f"version {version} is not newer than the published {latest.version}")
            chains = {fmt: self._chain_locked(version, fmt, loc) for fmt, loc in locations.items()}
            pv = PublishedVersion(version, locations, time.time(),
                                  {f: c for f, c in chains.items() if c is not None})
            self._versions[version] = pv
            needed = {v for c in pv.chains.values() for v, _, _ in c}
            for old in sorted(self._versions)[:-self.keep]:
                if old not in needed:  # a delta the newest version is built on stays fetchable
                    del self._versions[old]
            self._cond.notify_all()
        return pv

    def _chain_locked(self, version: int, fmt: str, loc: Location) -> list[tuple[int, int, Files]] | None:
        """The steps a sampler fetches to build ``version`` from the newest full snapshot we
        serve; ``None`` when the files cannot be served as stored (object stores)."""
        if loc.stored is None:
            return None
        if loc.base < 0:
            return [(version, -1, loc.stored)]
        prev = self._versions.get(loc.base)
        below = prev.chains.get(fmt) if prev is not None else None
        if not below:
            return None  # the base is not ours (published before this process): samplers use the store
        return [*below, (version, loc.base, loc.stored)]

    def latest_locked(self) -> PublishedVersion | None:
        return self._versions[max(self._versions)] if self._versions else None

    @property
    def latest(self) -> PublishedVersion | None:
        with self._cond:
            return self.latest_locked()

    def wait_newer(self, after: int, timeout: float) -> PublishedVersion | None:
        """The latest version if newer than ``after``, waiting up to ``timeout`` s for one."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._closed:
                latest = self.latest_locked()
                if latest is not None and latest.version > after:
                    return latest
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
        return None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def file(self, version: int, fmt: str, rel: str, stored: bool = False) -> tuple[Path, int]:
        """The path and listed size of a fetchable file; ``KeyError`` naming what is unknown.

        ``stored``: ``rel`` names a file as stored (a delta's blob); otherwise a file of the
        full directory, which only a full snapshot has on disk.
        """
        with self._cond:
            pv = self._versions.get(version)
        if pv is None:
            raise KeyError(f"version {version} is not (or no longer) published")
        if fmt not in pv.locations:
            raise KeyError(f"version {version} has no format {fmt!r} ({sorted(pv.locations)})")
        loc = pv.locations[fmt]
        files = loc.stored if stored or loc.base < 0 else None
        if files is None:
            raise KeyError(f"version {version} format {fmt!r} is stored as a delta against "
                           f"v{loc.base}: fetch its stored files (set have_version)" if loc.base >= 0
                           else f"version {version} format {fmt!r} is on an object store ({loc.path})")
        if rel not in files:
            raise KeyError(f"{rel!r} is not in the manifest of version {version} format {fmt!r}")
        return Path(loc.path) / rel, files[rel][0]

    @staticmethod
    def read_chunks(path: Path, offset: int, chunk: int = CHUNK_BYTES) -> Iterator[tuple[int, bytes]]:
        with open(path, "rb") as f:
            f.seek(offset)
            while data := f.read(chunk):
                yield offset, data
                offset += len(data)
