"""The bearer token file (``service.token_file``, ``mixrl-train serve --token-file``): a regular file
of at most ``MAX_TOKEN_FILE_BYTES``, checked with ``stat`` before it is opened and read with a bound.

A path from a config can name anything: ``/dev/zero`` (an unbounded ``read()`` of it filled 1.5 GB
in 12 s), a FIFO (``open`` blocks until a writer comes), a directory, a huge file. Each is one line
naming the path and what it is, at config load (``trainer_jax.config.service``) and again where the
token is read (``trainer_jax.service.auth``): the file can change in between. Only the standard
library: the trainer's config, samplers and launchers can all read token files with it.
"""

from __future__ import annotations

import os
import stat

#: a token is ~43 characters (``secrets.token_urlsafe(32)``); a page is ample room for any secret
MAX_TOKEN_FILE_BYTES = 4096


class TokenFileError(ValueError):
    """The token file is not a small regular file, or cannot be read."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _check(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise TokenFileError(f"token file {path} is {_kind(st.st_mode)}, not a regular file")
    if st.st_size > MAX_TOKEN_FILE_BYTES:
        raise TokenFileError(f"token file {path} is {st.st_size} bytes, more than the "
                             f"{MAX_TOKEN_FILE_BYTES} a token file may hold")


def check_token_file(path: str | os.PathLike) -> bool:
    """``stat`` only (follows links, opens nothing): ``False`` when there is no such file (the
    trainer writes a new token there), ``True`` for a small regular file, else
    ``TokenFileError``."""
    path = os.fspath(path)
    if not path:
        raise TokenFileError("token file: the path is empty (leave the key out to use "
                             "$MIXRL_TOKEN or <run>/token)")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as e:  # a symlink loop, a parent that is a file, a directory it cannot search
        raise TokenFileError(f"token file {path}: {e.strerror}") from None
    _check(path, st)
    return True


def read_token_text(path: str | os.PathLike) -> str | None:
    """The file's text, stripped; ``None`` when there is no such file. At most
    ``MAX_TOKEN_FILE_BYTES + 1`` bytes are ever read, and the open never blocks (``O_NONBLOCK``:
    a FIFO swapped in after the ``stat`` fails its ``fstat``, it does not wait for a writer)."""
    path = os.fspath(path)
    if not check_token_file(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise TokenFileError(f"token file {path}: {e.strerror}") from None
    try:
        _check(path, os.fstat(fd))  # what was opened, not what the path named a moment ago
        chunks, total = [], 0
        while total <= MAX_TOKEN_FILE_BYTES:
            try:
                chunk = os.read(fd, MAX_TOKEN_FILE_BYTES + 1 - total)
            except OSError as e:
                raise TokenFileError(f"token file {path}: {e.strerror}") from None
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > MAX_TOKEN_FILE_BYTES:  # it grew after the fstat
        raise TokenFileError(f"token file {path} holds more than the {MAX_TOKEN_FILE_BYTES} bytes "
                             "a token file may hold")
    try:
        return b"".join(chunks).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise TokenFileError(f"token file {path} is not UTF-8 text") from None


__all__ = ["MAX_TOKEN_FILE_BYTES", "TokenFileError", "check_token_file", "read_token_text"]
