"""Where published weight versions live: a local directory or any fsspec URL (``s3://bucket/p``).

Publication must stay atomic for every reader, whatever the store:

- a local directory builds a version in a temp directory beside it and renames it into place
  (``convert.atomic``); ``LATEST`` is rewritten through a temp name and a rename;
- an object store has no rename, so a version is uploaded under a temporary prefix
  (``.tmp-vNNNNNNNN-<id>/``), moved to ``vNNNNNNNN/`` (server-side copies), its ``version.json``
  written last inside it, and only then is ``LATEST`` written. Readers take a version only
  through ``LATEST`` or when its ``version.json`` exists, so one polling during a write sees the
  old version or the new one, never part of one.

``open_store`` checks the URL and the credentials at once (one line naming the problem), so a
misconfigured run fails at start-up rather than at its first publish.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

LATEST = "LATEST"
VERSION_FILE = "version.json"
_VERSION_DIR = re.compile(r"^v(\d{8,})$")


class StoreError(RuntimeError):
    """The weights store cannot be reached or is misconfigured."""


def version_dirname(version: int) -> str:
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    return f"v{version:08d}"


def is_url(root: str | os.PathLike) -> bool:
    return "://" in str(root) and not str(root).startswith("file://")


class Store:
    """One publish root. ``local`` is its path when the root is a local directory, else ``None``."""

    def __init__(self, root: str | os.PathLike, fs=None, path: str | None = None):
        self.root = str(root)
        self.fs, self.path = fs, path
        self.local: Path | None = None if fs is not None else Path(str(root).removeprefix("file://"))

    def __repr__(self) -> str:
        return f"Store({self.root!r})"

    # ------------------------------------------------------------------ reading

    def _remote(self, rel: str) -> str:
        return f"{self.path.rstrip('/')}/{rel}" if rel else self.path

    def read_text(self, rel: str) -> str | None:
        """The text of file ``rel`` under the root; ``None`` if it does not exist."""
        if self.local is not None:
            try:
                return (self.local / rel).read_text()
            except (FileNotFoundError, NotADirectoryError):
                return None
        try:
            return self.fs.cat_file(self._remote(rel)).decode()
        except FileNotFoundError:
            return None

    def exists(self, rel: str) -> bool:
        if self.local is not None:
            return (self.local / rel).exists()
        self.fs.invalidate_cache()
        return self.fs.exists(self._remote(rel))

    def get_dir(self, rel: str, dest: Path) -> None:
        """Copy directory ``rel`` of the store into the new local directory ``dest``."""
        if self.local is not None:
            shutil.copytree(self.local / rel, dest)
            return
        dest.mkdir(parents=True)
        self.fs.invalidate_cache()
        for remote in self.fs.find(self._remote(rel)):
            sub = remote[len(self._remote(rel)):].lstrip("/")
            (dest / sub).parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote, str(dest / sub))

    def get_file(self, rel: str, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if self.local is not None:
            shutil.copyfile(self.local / rel, dest)
        else:
            self.fs.get_file(self._remote(rel), str(dest))

    def latest(self) -> int | None:
        """The version ``LATEST`` names, or ``None`` before the first publish."""
        text = self.read_text(LATEST)
        m = _VERSION_DIR.match(text.strip()) if text else None
        return int(m.group(1)) if m else None

    def versions(self) -> list[int]:
        """Committed version numbers, ascending (an object store's: those with version.json)."""
        if self.local is not None:
            if not self.local.is_dir():
                return []
            return sorted(int(m.group(1)) for p in self.local.iterdir()
                          if p.is_dir() and (m := _VERSION_DIR.match(p.name)))
        self.fs.invalidate_cache()
        found = []
        for p in self.fs.glob(self._remote(f"v*/{VERSION_FILE}")):
            m = _VERSION_DIR.match(p.rstrip("/").split("/")[-2])
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    # ------------------------------------------------------------------ writing (object stores)

    def commit_version(self, stage: Path, version: int) -> None:
        """Upload the complete local directory ``stage`` as version ``version`` (object stores).

        Uploaded under a temporary prefix, moved into place, then ``version.json`` (kept back
        until now) marks it complete. ``LATEST`` is the caller's to write, last.
        """
        name = version_dirname(version)
        tmp = self._remote(f".tmp-{name}-{uuid.uuid4().hex[:8]}")
        final = self._remote(name)
        files = sorted(p for p in stage.rglob("*") if p.is_file() and p != stage / VERSION_FILE)
        try:
            for p in files:
                self.fs.put_file(str(p), f"{tmp}/{p.relative_to(stage).as_posix()}")
            for p in files:
                rel = p.relative_to(stage).as_posix()
                self.fs.mv(f"{tmp}/{rel}", f"{final}/{rel}")
            if (stage / VERSION_FILE).is_file():
                self.fs.put_file(str(stage / VERSION_FILE), f"{final}/{VERSION_FILE}")
        finally:
            if self.fs.exists(tmp):
                self.fs.rm(tmp, recursive=True)

    def write_latest(self, version: int) -> None:
        text = version_dirname(version) + "\n"
        if self.local is not None:
            from convert.atomic import atomic_write_text

            atomic_write_text(self.local / LATEST, text)
        else:
            self.fs.pipe_file(self._remote(LATEST), text.encode())  # one PUT: atomic on S3

    def remove_version(self, version: int) -> bool:
        """Delete one version; ``False`` if it was already gone."""
        name = version_dirname(version)
        if self.local is not None:
            path = self.local / name
            aside = self.local / f".{name}.deleting-{uuid.uuid4().hex[:8]}"
            try:
                os.replace(path, aside)  # no reader ever sees a half-deleted version
            except FileNotFoundError:
                return False
            shutil.rmtree(aside, ignore_errors=True)
            return True
        # version.json first: the version stops counting as committed before its files go.
        try:
            self.fs.rm_file(self._remote(f"{name}/{VERSION_FILE}"))
        except FileNotFoundError:
            return False
        self.fs.rm(self._remote(name), recursive=True)
        return True


def open_store(root: str | os.PathLike, **storage_options) -> Store:
    """A ``Store`` for a local directory or an fsspec URL, checked now; ``StoreError`` otherwise.

    A URL is checked by listing its root: an unknown scheme, a missing client library, missing
    credentials or an unreachable endpoint each give one line naming the URL and the problem.
    """
    root = str(root)
    if not is_url(root):
        return Store(root)
    scheme = root.split("://", 1)[0]
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(root, **storage_options)
    except ImportError as e:
        raise StoreError(f"weights root {root}: the {scheme}:// client is not installed ({e}); "
                         "pip install 'mixrl[store]'") from None
    except (ValueError, TypeError) as e:
        raise StoreError(f"weights root {root}: not a usable fsspec URL ({e})") from None
    if not path.strip("/"):
        raise StoreError(f"weights root {root}: names no bucket or directory")
    try:
        fs.ls(path.split("/", 1)[0] if scheme in ("s3", "gs", "gcs") else path, detail=False)
    except FileNotFoundError:
        raise StoreError(f"weights root {root}: the bucket or directory does not exist") from None
    except Exception as e:  # noqa: BLE001 - every client has its own errors; name it in one line
        kind = type(e).__name__
        hint = " (no credentials found: set them in the environment or the client's config)" \
            if "credential" in (kind + str(e)).lower() else ""
        raise StoreError(f"weights root {root}: cannot access it: {kind}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}{hint}") from None
    return Store(root, fs, path)
