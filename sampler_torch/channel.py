"""How ``RolloutClient`` reaches a trainer: the gRPC channel (options, TLS) and the retry policy
(which failures are transient, how long to wait between attempts, the error when it gives up).

Kept apart from the session logic in ``sampler_torch.client`` so that each reads on its own; the
public names are re-exported there (``from sampler_torch.client import Backoff, TLSOptions``).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from mixrl_wire import BULK_CHANNEL_OPTIONS

# Failures that say "not now" rather than "no": the call is retried after a backoff delay.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})


class RolloutError(RuntimeError):
    """A call failed for good (not retried, or out of retry time): ``code`` says why."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class TrainerGone(RolloutError):
    """The trainer stopped answering for longer than the client's ``gone_after_s``: its process
    exited, or its host or the network between went away."""

    def __init__(self, address: str, down_s: float):
        super().__init__(grpc.StatusCode.UNAVAILABLE, f"trainer at {address} is gone (unreachable "
                                                      f"for {down_s:.0f} s)")
        self.address = address


class ConnectTimeout(RolloutError):
    """Nothing answered at the trainer's address within the connect timeout."""


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Exponential backoff with multiplicative jitter."""

    initial_s: float = 0.05
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def delays(self) -> Iterator[float]:
        d = self.initial_s
        while True:
            yield d * (1 + random.uniform(-self.jitter, self.jitter))
            d = min(d * self.multiplier, self.max_s)


@dataclasses.dataclass(frozen=True)
class TLSOptions:
    """Client side of TLS: the CA that signed the server's cert; ``cert_file``/``key_file`` for mTLS."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None  # override the name checked against the server's certificate


def is_retryable(e: grpc.RpcError) -> bool:
    """Whether ``e`` is transient. gRPC reports an over-limit message as ``RESOURCE_EXHAUSTED``
    too, like backpressure; resending it would fail the same way, so it is not retried."""
    size_error = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (e.details() or "")
    return e.code() in RETRYABLE and not size_error


class BackpressureSignal(grpc.RpcError):
    """A stand-in error for the retry loop when a stream itself succeeded but asked us to back off."""

    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "backpressure"


def open_channel(address: str, tls: TLSOptions | None, max_message_bytes: int) -> grpc.Channel:
    """A channel to ``address`` for bulk trajectories, reconnecting quickly after a trainer restart."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        *BULK_CHANNEL_OPTIONS,
        # Reconnect quickly after a trainer restart (gRPC's default backoff reaches 120 s).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    read = lambda p: Path(p).read_bytes() if p else None
    creds = grpc.ssl_channel_credentials(root_certificates=read(tls.ca_file), private_key=read(tls.key_file),
                                         certificate_chain=read(tls.cert_file))
    return grpc.secure_channel(address, creds, options=options)


class Link:
    """How long a channel has been down: since it last left READY, or since its first connection
    attempt failed (``TRANSIENT_FAILURE``); 0 while connected. Fed by gRPC's connectivity
    callbacks, so it knows without a call of ours failing first."""

    def __init__(self, channel: grpc.Channel):
        self.channel = channel
        self._down_since: float | None = None
        self._ever_ready = False
        self._lock = threading.Lock()
        channel.subscribe(self._on_state)

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        with self._lock:
            if state == grpc.ChannelConnectivity.READY:
                self._down_since, self._ever_ready = None, True
            elif self._down_since is None and (
                    self._ever_ready or state == grpc.ChannelConnectivity.TRANSIENT_FAILURE):
                self._down_since = time.monotonic()

    def down_for(self) -> float:
        since = self._down_since
        return 0.0 if since is None else time.monotonic() - since

    def close(self) -> None:
        self.channel.unsubscribe(self._on_state)


def wait_ready(channel: grpc.Channel, address: str, timeout_s: float, *, stopped: Callable[[], bool],
               every_s: float = 15.0, on_wait: Callable[[float], None] | None = None) -> None:
    """Block until ``channel`` connects (something answers at ``address``).

    ``on_wait(seconds so far)`` every ``every_s`` while it waits; ``ConnectTimeout`` after
    ``timeout_s``; ``RolloutError`` ``CANCELLED`` once ``stopped()`` (a SIGTERM handler's
    ``request_stop``)."""
    future = grpc.channel_ready_future(channel)
    start = time.monotonic()
    report_at = start + every_s
    try:
        while True:
            try:
                future.result(timeout=0.2)
                return
            except grpc.FutureTimeoutError:
                pass
            if stopped():
                raise RolloutError(grpc.StatusCode.CANCELLED, "waiting for the trainer: client closed")
            now = time.monotonic()
            if now - start >= timeout_s:
                raise ConnectTimeout(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"nothing answered at {address} within {timeout_s:g} s")
            if on_wait is not None and now >= report_at:
                on_wait(now - start)
                report_at = now + every_s
    finally:
        future.cancel()

