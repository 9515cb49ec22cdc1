"""Security of the rollout service: the bearer token, TLS / mutual TLS credentials.

Every RPC carries ``authorization: Bearer <token>``; the interceptor compares it in constant time
and answers ``UNAUTHENTICATED`` otherwise. Health checking and reflection are exempt so load
balancers and ``grpcurl`` work without the secret. The token comes from ``--token-file`` /
``service.token_file`` or the ``MIXRL_TOKEN`` environment variable; there is no default token.
``mixrl-train`` (which starts the service with its learner) uses ``service.token_file``'s token
when the file exists and otherwise writes a new one there (``ensure_token_file``); without it, a
fresh token in ``<run>/token``. A token file is read with a bound (``mixrl_wire.token_file``): a
regular file of at most 4 KiB, never a device, FIFO or directory.
"""

from __future__ import annotations

import hmac
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path

import grpc

from mixrl_wire.token_file import TokenFileError, read_token_text
from trainer_jax.config import TLSConfig

TOKEN_ENV = "MIXRL_TOKEN"
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                   "/grpc.reflection.v1.ServerReflection/")


class TokenError(ValueError):
    """No usable bearer token was configured."""


def generate_token() -> str:
    """A fresh random token (for launchers that start the service and its samplers together)."""
    return secrets.token_urlsafe(32)


def resolve_token(token_file: str | os.PathLike | None = None, env: dict | None = None) -> str:
    """The token from ``token_file`` if given, else ``$MIXRL_TOKEN``; ``TokenError`` if neither."""
    env = os.environ if env is None else env
    if token_file is not None:
        path = Path(token_file)
        try:
            token = read_token_text(path)
        except TokenFileError as e:
            raise TokenError(str(e)) from None
        if token is None:
            raise TokenError(f"token file {path}: No such file or directory")
        if not token:
            raise TokenError(f"token file {path} is empty")
        return token
    token = env.get(TOKEN_ENV, "").strip()
    if not token:
        raise TokenError(f"no bearer token: set {TOKEN_ENV} or pass --token-file (service.token_file)")
    return token


def read_token_file(path: str | os.PathLike) -> str | None:
    """The token in ``path``, or None when there is no such file; ``TokenError`` (one line) when
    the file exists but cannot be read or holds only whitespace: a run must not start with a
    token its samplers cannot match."""
    path = Path(path)
    try:
        token = read_token_text(path)
    except TokenFileError as e:
        raise TokenError(str(e)) from None
    if token is None:
        return None
    if not token:
        raise TokenError(f"token file {path} is empty (delete it to have a new token generated)")
    return token


def write_token_file(path: str | os.PathLike, token: str, *, replace: bool = True) -> str:
    """Write ``token`` to ``path`` (mode 0600, parent directories created) through a temporary
    file in the same directory, so a reader sees the whole token or no file, never a part.

    ``replace=False``: an existing file wins (two writers racing: both return the one on disk).
    Returns the token the file holds afterwards.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
            return token
        try:
            os.link(tmp, path)  # atomic create-if-absent
        except FileExistsError:
            existing = read_token_file(path)
            if existing is None:  # removed in between: take the place
                os.replace(tmp, path)
                return token
            return existing
        except OSError:  # no hard links on this filesystem: the last writer wins
            os.replace(tmp, path)
        return token
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def ensure_token_file(path: str | os.PathLike) -> str:
    """The token of ``path`` when the file exists, else a fresh one written there (0600): how
    ``mixrl-train`` honours ``service.token_file``, so samplers started before the trainer, spawned
    ones and a resumed run all use the same secret."""
    token = read_token_file(path)
    return token if token is not None else write_token_file(path, generate_token(), replace=False)


def _abort_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
                   details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts with ``code``."""

    def abort(request_or_iterator, context: grpc.ServicerContext):
        context.abort(code, details)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls without the right ``authorization: Bearer`` metadata (exempt: health, reflection)."""

    def __init__(self, token: str, on_reject: Callable[[str], None] | None = None):
        if not token:
            raise TokenError("the bearer token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._on_reject = on_reject

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or method.startswith(EXEMPT_PREFIXES):
            return handler
        got = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value
                break
        if isinstance(got, str):
            got = got.encode()
        if hmac.compare_digest(got, self._expected):
            return handler
        if self._on_reject is not None:
            self._on_reject(method)
        return _abort_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                              "missing or wrong bearer token (authorization: Bearer <token>)")


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials | None:
    """Server credentials from PEM files, mutual TLS when ``client_ca_file`` is set; None: plaintext."""
    if not tls.enabled:
        return None
    key = Path(tls.key_file).read_bytes()
    cert = Path(tls.cert_file).read_bytes()
    if tls.client_ca_file:
        ca = Path(tls.client_ca_file).read_bytes()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    return grpc.ssl_server_credentials([(key, cert)])


def run_token(token_file: str | None, run_dir: Path, resume: bool) -> tuple[Path, str]:
    """The bearer token of a ``mixrl-train`` run and its file. ``service.token_file``: the file's
    token when it exists, else a new one (the trainer writes it there, 0600), so spawned samplers,
    samplers that join by address and a resumed run share it; ``TokenError`` for an empty or
    unreadable file. Without it: ``<run>/token``, fresh per run and kept by ``--resume`` (samplers
    that joined by address re-register with it)."""
    if token_file:
        path = Path(token_file).absolute()
        return path, read_token_file(path) or generate_token()
    path = run_dir / "token"
    try:
        kept = read_token_file(path) if resume else None
    except TokenError:
        kept = None
    return path, kept or generate_token()
