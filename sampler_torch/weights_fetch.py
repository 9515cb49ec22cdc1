"""Materializing a published weight version on a sampler: a verified local directory, or an error.

The trainer publishes each version with a sha256 manifest per format (``pb.WeightVersion``). A
sampler may load a directory only after every listed file matched it, whether the directory is
the trainer's own (a shared filesystem) or a copy downloaded over gRPC; a download lands in a
temporary directory renamed into place only when complete, so a crash never leaves a directory
that looks finished. A version published as a delta is materialized from the weights this sampler
holds plus the deltas since (``convert.delta``), read from the publish root when it is readable
here or fetched over gRPC, and verified against the full directory's manifest; any failure on
that path falls back to the newest full snapshot, and the old weights keep serving meanwhile.
The checks themselves are ``convert.manifest``'s; the transfer of one file is the session's
(``RolloutClient.fetch_file``), passed in here as ``fetch_file``.

No torch here, like ``sampler_torch.client``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from convert.delta import DELTA_NAME, DeltaError, materialize
from convert.manifest import ManifestError, check_relative, sha256_file, verify_files
from convert.store import StoreError, is_url, open_store
from mixrl_wire import pb

# (version, format, relative path, destination, size, sha256, *, have_version=None) -> None;
# raises WeightsError. With have_version the path names a stored file (a delta's blob).
FetchFile = Callable[..., None]


class WeightsError(RuntimeError):
    """Published weights could not be obtained or failed verification; keep the old ones."""


def check_downloaded(dest: Path, rel: str, version: int, fmt: str, size: int, sha256: str) -> None:
    """Raise ``WeightsError`` (and delete ``dest``) unless the downloaded ``dest`` matches the manifest."""
    got = dest.stat().st_size
    if got != size or sha256_file(dest) != sha256:
        dest.unlink(missing_ok=True)  # a bad partial file would be resumed from, never repaired
        raise WeightsError(f"{rel} of version {version} ({fmt}): "
                           + (f"size {got}, the manifest says {size}" if got != size
                              else "sha256 does not match the manifest (corrupt)"))


class _FetchedChain:
    """A ``convert.delta.ChainSource`` over the session: the steps the trainer announced with the
    version, each step's stored files downloaded with ``FetchWeights(have_version=...)``."""

    def __init__(self, loc: pb.WeightLocation, fetch_file: FetchFile, have: int | None):
        self.name = "the trainer"
        self.steps = {s.version: s for s in loc.chain}
        self.fetch_file, self.have = fetch_file, have

    def chain(self, version: int, fmt: str, have: int | None) -> tuple[int, list[int]]:
        steps, k = [], version
        while True:
            if have is not None and k == have:
                return k, steps[::-1]
            step = self.steps.get(k)
            if step is None:
                raise DeltaError(f"the trainer no longer serves version {k} of {fmt} (a gap)")
            if step.base < 0:
                return k, steps[::-1]
            steps.append(k)
            k = step.base

    def local_dir(self, version: int, fmt: str, work: Path) -> Path:
        dest = work / f"fetched-{version}"
        for f in self.steps[version].stored.files:
            try:
                check_relative(f.path)
            except ManifestError as e:
                raise WeightsError(str(e)) from None
            self.fetch_file(version, fmt, f.path, dest / f.path, f.size, f.sha256,
                            have_version=-1 if self.have is None else self.have)
        return dest


def _readable_store(store: str, transfer: str) -> bool:
    if not store or transfer == "fetch":
        return False
    return is_url(store) or Path(store).is_dir()


def materialize_weights(wv: pb.WeightVersion, cache_dir: str | os.PathLike, *, formats: Sequence[str],
                        fetch_file: FetchFile, cache_key: str, transfer: str = "auto",
                        held: Mapping[str, tuple[int, Path]] | None = None,
                        log: Callable[[str], None] | None = None) -> tuple[str, Path]:
    """``(format, directory)`` for version ``wv`` in the first of ``formats`` it offers.

    ``transfer``: ``shared`` uses the trainer's path or publish root, ``fetch`` downloads with
    ``fetch_file`` into ``cache_dir/<cache_key>-v<version>/<format>``, ``auto`` uses the path or
    root if readable here (a shared directory, an object store), else fetches. ``cache_key``
    names the trainer instance: a restarted trainer numbers versions anew. ``held``:
    ``{format: (version, directory)}`` already verified here; a version published as a delta is
    built from it when the chain reaches it, else from the newest full snapshot.
    """
    locations = {loc.format: loc for loc in wv.locations}
    fmt = next((f for f in formats if f in locations), None)
    if fmt is None:
        raise WeightsError(f"version {wv.version} offers formats {sorted(locations)}, "
                           f"this sampler takes {list(formats)}")
    loc = locations[fmt]
    files = {f.path: (f.size, f.sha256) for f in loc.manifest.files}
    if not files:
        raise WeightsError(f"version {wv.version} format {fmt}: empty manifest")
    have = (held or {}).get(fmt)
    shared = Path(loc.path)
    if transfer != "fetch" and not is_url(loc.path) and shared.is_dir() \
            and not (shared / DELTA_NAME).exists():
        problems = verify_files(shared, files)  # a full directory we can read: load it in place
        if problems:
            raise WeightsError(f"version {wv.version} format {fmt}: " + "; ".join(problems))
        return fmt, shared
    final = Path(cache_dir) / f"{cache_key}-v{wv.version:08d}" / fmt
    if final.is_dir() and not verify_files(final, files):
        return fmt, final  # fetched before (an earlier run, or a retry after a failed swap)
    if _readable_store(loc.store, transfer):
        source = open_store(loc.store)
    elif transfer == "shared":
        raise WeightsError(f"version {wv.version} format {fmt}: {loc.path} is not readable here")
    elif loc.chain:
        source = _FetchedChain(loc, fetch_file, None if have is None else have[0])
    else:
        _fetch_plain(wv.version, fmt, files, final, fetch_file)
        return fmt, final
    try:
        # checked against the trainer's announcement too, not just the store's word, with the
        # digests taken while the files are written (one pass, no second read)
        materialize(source, wv.version, fmt, final, have=have, expect=files, log=log)
    except (DeltaError, ManifestError, StoreError) as e:
        raise WeightsError(f"version {wv.version} format {fmt}: {e}") from None
    return fmt, final


def _fetch_plain(version: int, fmt: str, files: Mapping[str, tuple[int, str]], final: Path,
                 fetch_file: FetchFile) -> None:
    """Download every manifest file of a full directory into ``final`` (atomically)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{fmt}.part-", dir=final.parent))
    try:
        for rel, (size, sha) in sorted(files.items()):
            try:
                check_relative(rel)
            except ManifestError as e:
                raise WeightsError(str(e)) from None
            fetch_file(version, fmt, rel, tmp / rel, size, sha)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prune_cache(cache_dir: str | os.PathLike, cache_key: str, fmt: str, keep: Sequence[Path]) -> None:
    """Remove this trainer's cached ``fmt`` directories except ``keep`` (with deltas every
    version is materialized here, so old ones would pile up)."""
    keep_set = {Path(k).resolve() for k in keep}
    for d in Path(cache_dir).glob(f"{cache_key}-v*/{fmt}"):
        if d.resolve() not in keep_set:
            shutil.rmtree(d, ignore_errors=True)
            with contextlib.suppress(OSError):
                d.parent.rmdir()
