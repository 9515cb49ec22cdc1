"""Atomic publication of files and directories: readers see the old or the new, never half."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temp directory beside ``final``; on success rename it to ``final``.

    The temp directory lives in the same parent so the rename is atomic on POSIX. On any
    exception it is removed and ``final`` is untouched. With ``overwrite`` an existing ``final``
    is swapped out (renamed aside, then deleted) after the new one is complete; without it an
    existing ``final`` is an error raised before anything is written.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} already exists (pass overwrite to replace it)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        _fsync_dir(tmp)
        if final.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, aside / "old")
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a small text file through a temp name and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    # Make the renames durable; best effort on filesystems that do not support it.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
