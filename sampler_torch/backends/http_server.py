"""What the HTTP server backends (SGLang, vLLM) share: JSON over HTTP with one-line errors, the
server process they may start and stop, and weight versions from a response.

Only the standard library: a sampler attached to a remote server needs no HTTP client package.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence


class ServerError(RuntimeError):
    """The server refused a request, answered something malformed, or is not reachable."""


def request_json(url: str, method: str, path: str, body: dict | None, *, timeout: float,
                 error: type[ServerError] = ServerError):
    """``method url+path`` with a JSON body; the decoded JSON answer (``None`` when empty).

    Raises ``error`` with one line naming the call and the status or the reason.
    """
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        raise error(f"{method} {path}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise error(f"{method} {path}: {url} unreachable ({e})") from None
    if not raw:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        if path == "/health":  # some servers answer health checks in plain text
            return None
        raise error(f"{method} {path}: response is not JSON: {raw[:200]!r}") from None


def free_port(host: str) -> int:
    """A port nothing listens on now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(cmd: Sequence[str], *, log_path: str | os.PathLike | None = None,
                 env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start a server process, its output appended to ``log_path`` (else discarded)."""
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **dict(env or {})})
    finally:
        if log is not subprocess.DEVNULL:
            log.close()  # the child holds its own descriptor


def wait_healthy(probe, proc: subprocess.Popen, what: str, timeout: float,
                 error: type[ServerError] = ServerError) -> None:
    """Call ``probe()`` until it stops raising ``error``; fail if ``proc`` exits or on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise error(f"{what} exited with {proc.returncode} during startup "
                        f"({' '.join(map(str, proc.args))})")
        try:
            probe()
            return
        except error:
            if time.monotonic() > deadline:
                raise error(f"{what} not healthy after {timeout}s") from None
            time.sleep(2)


def stop_server(proc: subprocess.Popen | None, grace: float = 30.0) -> None:
    """Terminate a server we started (SIGTERM, then SIGKILL after ``grace`` seconds)."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def as_version(value, fallback: int) -> int:
    """A server's weight version as an int (a server started without one says "default")."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return fallback


def token_versions(spans, single: int, n: int) -> list[int]:
    """Per output position, the version from ``[{"version", "start", "end"}, ...]`` spans over
    output positions (SGLang's ``weight_versions``), ``single`` where no span covers it."""
    versions = [single] * n
    for span in spans or ():
        v = as_version(span.get("version"), single)
        for t in range(max(0, int(span["start"])), min(n, int(span["end"]))):
            versions[t] = v
    return versions


__all__ = ["ServerError", "as_version", "free_port", "request_json", "start_server",
           "stop_server", "token_versions", "wait_healthy"]
