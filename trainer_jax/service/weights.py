"""Published weight versions: where each format lives, its manifest, and chunked file serving.

``publish`` records version ``v`` as ``{format: directory}`` with a manifest per format: the
converter's ``manifest.json`` when the directory has one (``convert.manifest``), else one computed
here. ``manifest.json`` itself is listed too (hashed at publish time) so a sampler that fetches a
version over gRPC gets a directory the converter's own verification accepts. Only files listed in
a manifest of a retained version can be fetched: the file service is not a path oracle.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from convert.manifest import MANIFEST_NAME, build_manifest, read_manifest, sha256_file
from mixrl_wire import pb

CHUNK_BYTES = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class PublishedVersion:
    version: int
    # format -> (directory, {relative path: (size, sha256)})
    locations: dict[str, tuple[Path, dict[str, tuple[int, str]]]]
    published_unix: float

    def to_pb(self) -> pb.WeightVersion:
        locs = []
        for fmt, (path, files) in self.locations.items():
            manifest = pb.Manifest(files=[pb.FileDigest(path=rel, size=size, sha256=sha)
                                          for rel, (size, sha) in sorted(files.items())])
            locs.append(pb.WeightLocation(format=fmt, path=str(path), manifest=manifest))
        return pb.WeightVersion(version=self.version, locations=locs,
                                published_unix_ms=int(self.published_unix * 1000))


def manifest_files(path: Path, manifest: Mapping | None = None) -> dict[str, tuple[int, str]]:
    """``{relative path: (size, sha256)}`` for a weight directory (see module docstring)."""
    if manifest is None:
        manifest = read_manifest(path) if (path / MANIFEST_NAME).exists() else build_manifest(path)
        listed_self = (path / MANIFEST_NAME).exists()
    else:
        listed_self = False
    files = {rel: (int(e["size"]), str(e["sha256"])) for rel, e in manifest["files"].items()}
    if listed_self:
        files[MANIFEST_NAME] = ((path / MANIFEST_NAME).stat().st_size, sha256_file(path / MANIFEST_NAME))
    return files


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
        locations = {}
        for fmt, p in paths.items():
            path = Path(p).resolve()
            if not path.is_dir():
                raise FileNotFoundError(f"weights for format {fmt!r}: {path} is not a directory")
            locations[fmt] = (path, manifest_files(path, (manifests or {}).get(fmt)))
        pv = PublishedVersion(version, locations, time.time())
        with self._cond:
            latest = self.latest_locked()
            if latest is not None and version <= latest.version:
                raise ValueError(f"version {version} is not newer than the published {latest.version}")
            self._versions[version] = pv
            for old in sorted(self._versions)[:-self.keep]:
                del self._versions[old]
            self._cond.notify_all()
        return pv

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

    def file(self, version: int, fmt: str, rel: str) -> tuple[Path, int]:
        """The path and listed size of a fetchable file; ``KeyError`` naming what is unknown."""
        with self._cond:
            pv = self._versions.get(version)
        if pv is None:
            raise KeyError(f"version {version} is not (or no longer) published")
        if fmt not in pv.locations:
            raise KeyError(f"version {version} has no format {fmt!r} ({sorted(pv.locations)})")
        root, files = pv.locations[fmt]
        if rel not in files:
            raise KeyError(f"{rel!r} is not in the manifest of version {version} format {fmt!r}")
        return root / rel, files[rel][0]

    @staticmethod
    def read_chunks(path: Path, offset: int, chunk: int = CHUNK_BYTES) -> Iterator[tuple[int, bytes]]:
        with open(path, "rb") as f:
            f.seek(offset)
            while data := f.read(chunk):
                yield offset, data
                offset += len(data)
