"""Materializing a published weight version on a sampler: a verified local directory, or an error.

The trainer publishes each version with a sha256 manifest per format (``pb.WeightVersion``). A
sampler may load a directory only after every listed file matched it, whether the directory is
the trainer's own (a shared filesystem) or a copy downloaded over gRPC; a download lands in a
temporary directory renamed into place only when complete, so a crash never leaves a directory
that looks finished. The checks themselves are ``convert.manifest``'s; the transfer of one file
is the session's (``RolloutClient.fetch_file``), passed in here as ``fetch_file``.

No torch here, like ``sampler_torch.client``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from convert.manifest import ManifestError, check_relative, sha256_file, verify_files
from mixrl_wire import pb

# (version, format, relative path, destination, size, sha256) -> None; raises WeightsError.
FetchFile = Callable[[int, str, str, Path, int, str], None]


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


def materialize_weights(wv: pb.WeightVersion, cache_dir: str | os.PathLike, *, formats: Sequence[str],
                        fetch_file: FetchFile, cache_key: str, transfer: str = "auto") -> tuple[str, Path]:
    """``(format, directory)`` for version ``wv`` in the first of ``formats`` it offers.

    ``transfer``: ``shared`` uses the trainer's path, ``fetch`` downloads with ``fetch_file`` into
    ``cache_dir/<cache_key>-v<version>/<format>``, ``auto`` uses the path if it exists here, else
    fetches. ``cache_key`` names the trainer instance: a restarted trainer numbers versions anew.
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
    shared = Path(loc.path)
    if transfer == "shared" or (transfer == "auto" and shared.is_dir()):
        problems = verify_files(shared, files)
        if problems:
            raise WeightsError(f"version {wv.version} format {fmt}: " + "; ".join(problems))
        return fmt, shared
    final = Path(cache_dir) / f"{cache_key}-v{wv.version:08d}" / fmt
    if final.is_dir() and not verify_files(final, files):
        return fmt, final  # fetched before (an earlier run, or a retry after a failed swap)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{fmt}.part-", dir=final.parent))
    try:
        for rel, (size, sha) in sorted(files.items()):
            try:
                check_relative(rel)
            except ManifestError as e:
                raise WeightsError(str(e)) from None
            fetch_file(wv.version, fmt, rel, tmp / rel, size, sha)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return fmt, final
