"""What the HTTP server backends (SGLang, vLLM) share: JSON over HTTP with one-line errors, the
server process they may start and stop, and weight versions from a response.

Only the standard library: a sampler attached to a remote server needs no HTTP client package.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from sampler_torch.engine.params import Completion, SamplingParams, per_request
from sampler_torch.recipes import Recipe, get_recipe, verify_export


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


def request_status(url: str, method: str, path: str, body: dict | None, *,
                   timeout: float, error: type[ServerError] = ServerError):
    """``(HTTP status, decoded JSON or None)`` for ``method url+path``: for probes whose
    status is the answer (a route that is missing, disabled or refuses an empty body)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            code, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        code, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise error(f"{method} {path}: {url} unreachable ({e})") from None
    try:
        return code, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return code, None


def free_port(host: str) -> int:
    """A port nothing listens on now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_log_path(log_path: str | os.PathLike | None, name: str) -> Path:
    """Where a started server writes its output: ``log_path``, else a new temp file (kept, so
    a failed start can still be read after the error)."""
    if log_path:
        return Path(log_path)
    fd, path = tempfile.mkstemp(prefix=f"mixrl-{name.replace(' ', '-')}-", suffix=".log")
    os.close(fd)
    return Path(path)


def log_tail(path: str | os.PathLike | None, lines: int = 20) -> str:
    """The last ``lines`` lines of a server log (empty when there is none)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def require_module(python: str, module: str, error: type[ServerError] = ServerError,
                   hint: str = "") -> None:
    """Fail in one line, before a server starts, when ``python`` cannot import ``module``."""
    try:
        done = subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                              timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise error(f"cannot run {python} to check for the {module!r} package: {e}") from None
    if done.returncode != 0:
        raise error(f"{python} has no {module!r} package{hint}")


def start_server(cmd: Sequence[str], *, log_path: str | os.PathLike,
                 env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start a server process, its output appended to ``log_path``."""
    with open(log_path, "ab") as log:  # the child holds its own descriptor
        return subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **dict(env or {})})


def wait_healthy(probe, proc: subprocess.Popen, what: str, timeout: float,
                 error: type[ServerError] = ServerError,
                 log_path: str | os.PathLike | None = None) -> None:
    """Call ``probe()`` until it stops raising ``error``; fail if ``proc`` exits or on timeout,
    with the last lines of the server's own log."""
    deadline = time.monotonic() + timeout

    def fail(why: str):
        tail = log_tail(log_path)
        where = f" (log: {log_path})" if log_path else ""
        return error(f"{what} {why}{where}" + (f"; its last log lines:\n{tail}" if tail else ""))

    while True:
        if proc.poll() is not None:
            raise fail(f"exited with {proc.returncode} during startup "
                       f"({' '.join(map(str, proc.args))})")
        try:
            probe()
            return
        except error:
            if time.monotonic() > deadline:
                stop_server(proc)
                raise fail(f"not healthy after {timeout}s") from None
            time.sleep(0.5)


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


def truncates(p: SamplingParams) -> bool:
    """Whether a request samples from a kept set (greedy, top-p or top-k)."""
    return p.temperature == 0 or p.top_p < 1 or p.top_k > 0


def new_completion(index: int, prompt: list[int], p: SamplingParams, seed: int, *,
                   stopped: bool) -> Completion:
    """An empty ``Completion`` for one request; support lists only when it samples a kept set."""
    kept_set = truncates(p)
    return Completion(index=index, prompt_ids=prompt, seed=seed,
                      support_ids=[] if kept_set else None,
                      support_logprobs=[] if kept_set else None,
                      finish_reason="stop" if stopped else "length")


def add_token(out: Completion, p: SamplingParams, token: int, logprob: float,
              ranked: Sequence[tuple[float, int]]) -> None:
    """Append one output token: its id, its full-distribution log q and the ``p.head_k`` best
    of ``ranked`` ((log q, id) pairs, best first). The caller appends ``logprobs`` (and the
    support, for a kept set)."""
    out.token_ids.append(token)
    out.logprobs_full.append(logprob)
    out.head_ids.append([i for _, i in ranked[: p.head_k]])
    out.head_logprobs.append([v for v, _ in ranked[: p.head_k]])


class ServerBackend:
    """The lifecycle both server backends share: attach by URL, or ``launch`` a server process
    for a recipe (stopped by ``close``), JSON requests with one-line errors, and how many top
    logprobs a request needs. Subclasses set ``error`` and ``server_name`` and implement
    ``server_command``, ``generate`` and ``load_weights``.

    ``support_logprobs_num``: how many top logprobs to request when a request truncates and has
    no top-k (they must cover the kept set).
    """

    error: type[ServerError] = ServerError
    server_name = "server"
    #: the package a started server's Python must import (checked before it starts), and how
    #: to point the backend at a Python that has it
    server_package: str | None = None
    python_hint = "point the backend at a Python that has it"

    def __init__(self, url: str, *, recipe: str | Recipe = "bf16", version: int = 0,
                 timeout: float = 600.0, support_logprobs_num: int = 256,
                 process: subprocess.Popen | None = None,
                 model_dir: str | os.PathLike | None = None,
                 log_path: str | os.PathLike | None = None):
        self.url = url.rstrip("/")
        self.recipe = get_recipe(recipe)
        self.version = version
        self.timeout = timeout
        self.support_logprobs_num = support_logprobs_num
        self.process = process
        #: the export the server holds (tokenizer files for environments); None if unknown
        self.model_dir = model_dir
        #: where a server this backend started writes its output
        self.log_path = log_path

    @classmethod
    def server_command(cls, model_dir: str | os.PathLike, recipe: Recipe, *, version: int,
                       host: str, port: int, options: dict) -> tuple[list[str], dict, dict]:
        """``(command, extra environment, extra constructor keywords)`` that start a server for
        ``recipe``; ``options`` are the constructor keywords ``launch`` was given. The command's
        first word is the server's Python."""
        raise NotImplementedError

    def on_ready(self) -> None:
        """Called once a launched server answers its health check (start-up checks)."""

    @classmethod
    def launch(cls, model_dir: str | os.PathLike, recipe: str | Recipe = "bf16", *,
               version: int = 0, host: str = "127.0.0.1", port: int | None = None,
               extra_args: Sequence[str] = (), startup_timeout: float = 900.0,
               log_path: str | os.PathLike | None = None, **kwargs):
        """Start a server for ``recipe`` on ``model_dir`` and wait until it is healthy.

        Its output always goes to a file (``log_path``, else a temp file): a server that fails
        to start raises with the last lines of that log."""
        recipe = get_recipe(recipe)
        verify_export(model_dir, require_manifest=False)
        port = port or free_port(host)
        cmd, env, more = cls.server_command(model_dir, recipe, version=version, host=host,
                                            port=port, options=kwargs)
        if cls.server_package:
            require_module(cmd[0], cls.server_package, cls.error,
                           f"; install it there (pip install {cls.server_package}) or "
                           f"{cls.python_hint}")
        temp_log = not log_path
        log_path = server_log_path(log_path, cls.server_name)
        proc = start_server([*cmd, *extra_args], log_path=log_path, env=env)
        try:
            backend = cls(f"http://{host}:{port}", recipe=recipe, version=version, process=proc,
                          model_dir=model_dir, log_path=log_path, **more, **kwargs)
        except BaseException:
            stop_server(proc)
            raise
        try:
            wait_healthy(lambda: backend._request("GET", "/health", None, timeout=5), proc,
                         cls.server_name, startup_timeout, cls.error, log_path)
            backend.on_ready()
        except BaseException:
            backend.close()  # the log stays for reading
            raise
        backend._temp_log = temp_log
        return backend

    def close(self) -> None:
        """Stop a server this backend launched (a server given by URL is left alone); a temp
        log of a server that started fine goes with it."""
        stop_server(self.process)
        self.process = None
        if getattr(self, "_temp_log", False) and self.log_path:
            Path(self.log_path).unlink(missing_ok=True)
            self._temp_log = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, body: dict | None, *,
                 timeout: float | None = None):
        return request_json(self.url, method, path, body, timeout=timeout or self.timeout,
                            error=self.error)

    @staticmethod
    def per_request(prompts: Sequence[Sequence[int]],
                    params: SamplingParams | Sequence[SamplingParams]
                    ) -> tuple[list[SamplingParams], list[int]]:
        """One ``SamplingParams`` and seed per prompt (``engine.params.per_request``); every
        prompt must hold a token."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        return per_request(len(prompts), params)

    def top_logprobs_needed(self, p: SamplingParams) -> int:
        """Top logprobs a request must return: the head and, when truncating, the kept set."""
        if p.temperature == 0:
            return max(p.head_k, 1)
        if p.top_k > 0:
            return max(p.head_k, p.top_k)
        return max(p.head_k, self.support_logprobs_num if truncates(p) else 0)


__all__ = ["ServerBackend", "ServerError", "as_version", "free_port", "log_tail", "request_json",
           "request_status", "require_module", "server_log_path", "start_server", "stop_server",
           "token_versions", "truncates", "wait_healthy"]
