"""Read a file the model wrote, from the root harness, without trusting anything about it.

The harness runs as root outside the jail, so a path into the episode directory is not a file the
model can read but one it can *name*: a symlink to ``/proc/kmsg`` would block a plain ``open``
forever, one to a host file would let root read what the jail cannot (a 0600 secret), one to a
1.5 GB file would cost seconds and gigabytes. So every component is opened relative to a
directory descriptor with ``O_NOFOLLOW`` (a symlink anywhere is refused, never followed), the last
one with ``O_NONBLOCK`` (a FIFO cannot block), and only a regular file with a single link, at most
``max_bytes`` long, is read, and never more than ``max_bytes + 1`` bytes of it.

Text is decoded with replacement: a non-UTF-8 file is the model's output, not an exception.
"""

from __future__ import annotations

import errno
import os
import stat

#: The default cap on a file the harness reads back (checks compare short answers).
MAX_FILE_BYTES = 64 * 1024


class JailFileError(Exception):
    """A file the harness refuses to read; ``reason`` is a short metric name."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _components(relpath: str) -> list[str]:
    parts = [p for p in relpath.split("/") if p not in ("", ".")]
    if relpath.startswith("/") or not parts or ".." in parts or "\0" in relpath:
        raise JailFileError("file_bad_path", f"{relpath!r} is not a relative path inside the sandbox")
    return parts


def read_jail_bytes(root: str | os.PathLike, relpath: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of ``root/relpath``, refusing (``JailFileError``) symlinks at any component,
    anything but a regular single-link file, and files over ``max_bytes``.

    ``root`` itself is the harness's own directory (trusted); everything below it is not.
    """
    parts = _components(relpath)
    dir_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fds: list[int] = []
    try:
        fds.append(os.open(root, dir_flags))
        for name in parts[:-1]:
            fds.append(_open_at(name, dir_flags, fds[-1], relpath))
        fd = _open_at(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                      fds[-1], relpath)
        fds.append(fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise JailFileError("file_not_regular", f"{relpath!r} is not a regular file")
        if st.st_nlink != 1:  # a hard link names a file the model did not create here
            raise JailFileError("file_hard_link", f"{relpath!r} has {st.st_nlink} links")
        if st.st_size > max_bytes:
            raise JailFileError("file_too_large", f"{relpath!r} is {st.st_size} bytes (cap {max_bytes})")
        chunks, size = [], 0
        while size <= max_bytes:  # the file may grow while we read: never read past the cap
            data = os.read(fd, max_bytes + 1 - size)
            if not data:
                break
            chunks.append(data)
            size += len(data)
        if size > max_bytes:
            raise JailFileError("file_too_large", f"{relpath!r} grew past {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        for fd in reversed(fds):
            os.close(fd)


def read_jail_text(root: str | os.PathLike, relpath: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """``read_jail_bytes`` decoded as UTF-8 with replacement characters for invalid bytes."""
    return read_jail_bytes(root, relpath, max_bytes).decode("utf-8", errors="replace")


def _open_at(name: str, flags: int, dir_fd: int, relpath: str) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise JailFileError("file_symlink", f"{relpath!r}: {name!r} is a symlink") from None
        if e.errno == errno.ENOTDIR:  # an intermediate component that is a symlink or a file
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            reason = "file_symlink" if stat.S_ISLNK(st.st_mode) else "file_not_regular"
            raise JailFileError(reason, f"{relpath!r}: {name!r} is not a directory") from None
        if e.errno == errno.ENOENT:
            raise JailFileError("file_missing", f"{relpath!r} does not exist") from None
        raise JailFileError("file_unreadable", f"{relpath!r}: {e.strerror}") from None


__all__ = ["MAX_FILE_BYTES", "JailFileError", "read_jail_bytes", "read_jail_text"]
