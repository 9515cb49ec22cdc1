"""``RolloutClient``: how any sampler — ours or an external SGLang/vLLM fleet — talks to a mixrl trainer.

It wraps the ``mixrl.v1.Rollout`` service (register, lease, heartbeat, submit, watch and fetch
weights, status) with the behaviour a sampler wants on a flaky network:

- transient failures (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, backpressure ``RESOURCE_EXHAUSTED``)
  are retried with exponential backoff and jitter; the channel reconnects by itself;
- a lost session (the service restarted, or this sampler was silent too long) is re-registered
  transparently; a submission bound to a lease of the lost session is reported, not retried;
- submissions are idempotent on the server (lease, sample index), so a retry after an ambiguous
  failure is acknowledged as a duplicate instead of being counted twice;
- weight files are verified against the sha256 manifest the trainer published before anyone may
  load them (``materialize_weights``, in ``sampler_torch.weights_fetch``).

Trajectories are encoded by ``mixrl_wire.encoder`` (``encode_trajectory``, re-exported here with
``EncodedTrajectory`` and ``build_trajectory`` for callers of this module). No torch here: an
external sampler needs only this module, ``mixrl_wire``, ``convert.manifest`` and numpy.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import grpc

from mixrl_wire import SERVICE_NAME, pb, pb_grpc
from mixrl_wire.encoder import EncodedTrajectory, build_trajectory, encode_trajectory, size_bound
from sampler_torch.channel import (
    RETRYABLE,
    Backoff,
    BackpressureSignal,
    ConnectTimeout,
    Link,
    RolloutError,
    TLSOptions,
    TrainerGone,
    is_retryable,
    open_channel,
    wait_ready,
)
from sampler_torch.weights_fetch import WeightsError, check_downloaded, materialize_weights, prune_cache

__all__ = ["Backoff", "ConnectTimeout", "EncodedTrajectory", "RolloutClient", "RolloutError", "SubmitResult",
           "TLSOptions", "TrainerGone", "WeightsError", "build_trajectory", "encode_trajectory"]

log = logging.getLogger("mixrl.client")

_OK = grpc.StatusCode.OK
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_DEFAULT_BACKOFF = Backoff()  # frozen: one shared default is safe


@dataclasses.dataclass(frozen=True)
class SubmitResult:
    task_id: int
    sample_index: int
    code: grpc.StatusCode
    reason: str = ""
    duplicate: bool = False

    @property
    def accepted(self) -> bool:
        """True when the sample is in (now, or by an earlier attempt: ``duplicate``)."""
        return self.code == _OK


class RolloutClient:
    """A session with one trainer. Thread-safe: the sampler loop, its heartbeat and its weights
    watcher share one client (one channel)."""

    def __init__(self, address: str, token: str, *, group: str, recipe: pb.Recipe | Mapping | str = "bf16",
                 accelerator: str = "", capacity: int = 1, weight_formats: Sequence[str] = ("bf16",),
                 name: str | None = None, tls: TLSOptions | None = None,
                 max_message_bytes: int | None = None, backoff: Backoff = _DEFAULT_BACKOFF,
                 rpc_timeout_s: float = 30.0, max_retry_s: float | None = None,
                 device: pb.ComputeDevice | Mapping | None = None, gone_after_s: float | None = None):
        if not token:
            raise ValueError("a bearer token is required (MIXRL_TOKEN or --token-file)")
        self.address = address
        self.group = group
        if isinstance(recipe, str):
            recipe = pb.Recipe(name=recipe)
        elif isinstance(recipe, Mapping):
            recipe = pb.Recipe(**recipe)
        self.recipe = recipe
        self.accelerator = accelerator
        # What the engine computes on (``mixrl-sample``'s ``compute_report``): type, name,
        # capability, per-recipe native/emulate kernels; extra keys (``index``) are not sent.
        if isinstance(device, Mapping):
            device = pb.ComputeDevice(type=device.get("type", ""), name=device.get("name", ""),
                                      capability=device.get("capability", ""),
                                      kernels=dict(device.get("kernels", {})))
        self.device = device
        self.capacity = capacity
        self.weight_formats = tuple(weight_formats)
        # {format: (version, directory)} last materialized: the base the next delta applies to
        self._held: dict[str, tuple[int, Path]] = {}
        self._held_key: str | None = None
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.backoff = backoff
        self.rpc_timeout_s = rpc_timeout_s
        self.max_retry_s = max_retry_s
        # None: the limit the trainer advertises at registration (service.limits.max_message_bytes,
        # raised for long rows); 64 MiB until then. A given value caps it.
        self._own_limit = max_message_bytes
        self.max_message_bytes = 64 * 1024**2 if max_message_bytes is None else max_message_bytes
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.session_id: str | None = None
        self.server_id: str | None = None
        self.info: pb.RegisterResponse | None = None
        self.registrations = 0
        self.gone: TrainerGone | None = None  # set when the heartbeat found the trainer gone
        self.expired_leases: set[str] = set()
        self._channel = open_channel(address, tls, -1 if max_message_bytes is None else max_message_bytes)
        # gone_after_s: a retried call gives up with TrainerGone once the channel has been down
        # (not READY since it failed) that long; None: retry for as long as max_retry_s allows.
        self.gone_after_s = gone_after_s
        self._link = Link(self._channel)
        self._stub = pb_grpc.RolloutStub(self._channel)
        # Submit and SubmitStream send serialized bytes as they are: an ``EncodedTrajectory`` is
        # already on the wire format, a ``pb.Trajectory`` is serialized once by ``_wire_bytes``.
        self._submit = self._channel.unary_unary(
            f"/{SERVICE_NAME}/Submit", request_serializer=None,
            response_deserializer=pb.SubmitAck.FromString, _registered_method=True)
        self._submit_stream = self._channel.stream_stream(
            f"/{SERVICE_NAME}/SubmitStream", request_serializer=None,
            response_deserializer=pb.SubmitAck.FromString, _registered_method=True)

    # ---------------------------------------------------------------- plumbing

    def close(self) -> None:
        self._closed.set()
        self._link.close()
        self._channel.close()

    def down_for(self) -> float:
        """Seconds since the channel last lost (or failed to make) its connection; 0 while up."""
        return self._link.down_for()

    def wait_ready(self, timeout_s: float, *, every_s: float = 15.0,
                   on_wait: Callable[[float], None] | None = None) -> None:
        """Block until something answers at the trainer's address (``channel.wait_ready``)."""
        wait_ready(self._channel, self.address, timeout_s, stopped=self._closed.is_set, every_s=every_s,
                   on_wait=on_wait)

    def request_stop(self) -> None:
        """Make retries and new calls give up (CANCELLED) without closing the channel under a
        call in flight: safe from a signal handler. ``close()`` afterwards."""
        self._closed.set()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _sleep(self, delays: Iterator[float], start: float, what: str, e: grpc.RpcError) -> None:
        if (self.gone_after_s is not None and e.code() == grpc.StatusCode.UNAVAILABLE
                and self.down_for() > self.gone_after_s):
            raise TrainerGone(self.address, self.down_for())
        if self.max_retry_s is not None and time.monotonic() - start > self.max_retry_s:
            raise RolloutError(e.code(), f"{what}: gave up after {self.max_retry_s:.0f} s: {e.details()}")
        d = next(delays)
        log.debug("%s: %s (%s), retrying in %.2f s", what, e.code().name, e.details(), d)
        if self._closed.wait(d):
            raise RolloutError(grpc.StatusCode.CANCELLED, f"{what}: client closed")

    def _call(self, what: str, fn: Callable[[], object], *, session: bool = True):
        """Run ``fn`` with retries; with ``session``, (re-)register first and after a lost session."""
        delays, start = self.backoff.delays(), time.monotonic()
        while True:
            if self._closed.is_set():
                raise RolloutError(grpc.StatusCode.CANCELLED, f"{what}: client closed")
            try:
                if session and self.session_id is None:
                    self._register_once()
                return fn()
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.NOT_FOUND and session and "session" in (e.details() or ""):
                    self._forget_session()
                    continue
                # CANCELLED that we did not cause: a trainer shutting down cancels the calls in
                # flight. Retried like UNAVAILABLE, so a trainer that stays away ends the sampler
                # as "gone" (exit 1) and one that restarts is rejoined; a plain break here read
                # the end of a run as our own stop (exit 0).
                if is_retryable(e) or (code == grpc.StatusCode.CANCELLED and not self._closed.is_set()):
                    self._sleep(delays, start, what, e)
                    continue
                raise RolloutError(code, e.details() or "") from None

    def _forget_session(self) -> None:
        with self._lock:
            self.session_id = None

    # ---------------------------------------------------------------- session

    def _register_once(self) -> pb.RegisterResponse:
        with self._lock:
            if self.session_id is not None and self.info is not None:
                return self.info
            req = pb.RegisterRequest(group=self.group, recipe=self.recipe, accelerator=self.accelerator,
                                     capacity=self.capacity, weight_formats=list(self.weight_formats),
                                     name=self.name, device=self.device)
            resp = self._stub.Register(req, timeout=self.rpc_timeout_s, metadata=self._metadata)
            if self.server_id is not None and resp.server_id != self.server_id:
                log.warning("trainer restarted (server %s -> %s); new session", self.server_id,
                            resp.server_id)
            self.info, self.session_id, self.server_id = resp, resp.session_id, resp.server_id
            self.registrations += 1
            if resp.max_message_bytes:
                self.max_message_bytes = (resp.max_message_bytes if self._own_limit is None
                                          else min(self._own_limit, resp.max_message_bytes))
            return resp

    def register(self) -> pb.RegisterResponse:
        """Register (once; again only after the session is lost). Retries until the trainer is up."""
        return self._call("register", lambda: self.info)

    # ---------------------------------------------------------------- work

    def lease(self, max_samples: int) -> pb.LeaseResponse:
        """Lease up to ``max_samples`` samples; an empty answer carries ``retry_after_ms``."""
        return self._call("lease", lambda: self._stub.Lease(
            pb.LeaseRequest(session_id=self.session_id, max_samples=max_samples),
            timeout=self.rpc_timeout_s, metadata=self._metadata))

    def heartbeat(self, weights_version: int = -1, weight_failures: int = 0,
                  active_samples: int = 0) -> pb.HeartbeatResponse:
        return self._call("heartbeat", lambda: self._stub.Heartbeat(
            pb.HeartbeatRequest(session_id=self.session_id, weights_version=weights_version,
                                weight_failures=weight_failures, active_samples=active_samples),
            timeout=self.rpc_timeout_s, metadata=self._metadata))

    def return_lease(self, lease_id: str, reason: str, env: str = "") -> pb.ReturnLeaseResponse:
        """Give back a lease this sampler cannot run (``env``: the environment it cannot build,
        whose tasks the trainer then leases to others)."""
        return self._call("return_lease", lambda: self._stub.ReturnLease(
            pb.ReturnLeaseRequest(session_id=self.session_id, lease_id=lease_id, reason=reason,
                                  env=env), timeout=self.rpc_timeout_s, metadata=self._metadata))

    def report_probe(self, report: pb.ProbeReport) -> pb.ProbeAck:
        """Send the version probe's scores after a load (``sampler_torch.probe``); the answer
        says whether to reload or that the session is revoked."""
        def call() -> pb.ProbeAck:
            report.session_id = self.session_id or ""  # the current one, after a re-register
            return self._stub.ReportProbe(report, timeout=self.rpc_timeout_s,
                                          metadata=self._metadata)

        return self._call("report_probe", call)

    def start_heartbeat(self, report: Callable[[], tuple[int, int, int]] | None = None) -> threading.Thread:
        """Send heartbeats from a daemon thread at the interval the trainer asked for, until closed.

        ``report() -> (weights_version, weight_failures, active_samples)`` fills each heartbeat.
        Lease ids the trainer reports as ended collect in ``expired_leases`` (stop working on them).
        A sampler that never heartbeats loses its session, and its leases, after ``session_ttl``.
        """

        def beat() -> None:
            while not self._closed.is_set():
                try:
                    resp = self.heartbeat(*(report() if report else (-1, 0, 0)))
                    self.expired_leases.update(resp.expired_lease_ids)
                except TrainerGone as e:  # every call now gives up (CANCELLED); gone says why
                    self.gone = e
                    self._closed.set()
                    return
                except RolloutError as e:
                    if self._closed.is_set():
                        return
                    log.warning("heartbeat: %s", e)
                except ValueError:  # the channel was closed under us
                    return
                interval = self.info.heartbeat_interval_ms / 1000 if self.info else 1.0
                self._closed.wait(interval)

        t = threading.Thread(target=beat, name="mixrl-heartbeat", daemon=True)
        t.start()
        return t

    def status(self) -> pb.StatusResponse:
        return self._call("status", lambda: self._stub.Status(
            pb.StatusRequest(), timeout=self.rpc_timeout_s, metadata=self._metadata), session=False)

    def _wire_bytes(self, traj: pb.Trajectory | EncodedTrajectory) -> bytes | SubmitResult:
        """The serialized ``traj`` for this session, or a local refusal (over the size limit)."""
        sid = self.session_id or ""
        if isinstance(traj, EncodedTrajectory):
            data = traj.for_session(sid)
            size = len(data)
        else:
            traj.session_id = sid
            size = size_bound(traj)  # refuse a huge message before serializing it
            data = b""
            if size <= self.max_message_bytes:
                data = traj.SerializeToString()
                size = len(data)
        if size > self.max_message_bytes:
            return SubmitResult(traj.task_id, traj.sample_index, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"trajectory of {size} bytes exceeds the {self.max_message_bytes}-byte limit")
        return data

    def submit(self, traj: pb.Trajectory | EncodedTrajectory) -> SubmitResult:
        """Submit one trajectory; retried on transient errors (safe: idempotent on the server).

        ``traj``: a message (``build_trajectory``) or, cheaper, the wire bytes ``encode_trajectory``
        wrote. Never raises for a refused sample: the result's ``code``/``reason`` say why
        (``INVALID_ARGUMENT`` naming the field, ``NOT_FOUND`` if the lease died with a lost session).
        """
        if self.session_id is None:
            self.register()
        delays, start = self.backoff.delays(), time.monotonic()
        while True:
            data = self._wire_bytes(traj)
            if isinstance(data, SubmitResult):
                return data
            try:
                ack = self._submit(data, timeout=self.rpc_timeout_s, metadata=self._metadata)
                return SubmitResult(ack.task_id, ack.sample_index, _OK, duplicate=ack.duplicate)
            except grpc.RpcError as e:
                code = e.code()
                if (is_retryable(e) or code == grpc.StatusCode.CANCELLED) and not self._closed.is_set():
                    try:
                        self._sleep(delays, start, "submit", e)
                    except RolloutError as gave_up:
                        return SubmitResult(traj.task_id, traj.sample_index, gave_up.code, gave_up.details)
                    continue
                if code == grpc.StatusCode.NOT_FOUND:
                    self._forget_session()
                return SubmitResult(traj.task_id, traj.sample_index, code, e.details() or "")

    def submit_many(self, trajs: Iterable[pb.Trajectory | EncodedTrajectory]) -> list[SubmitResult]:
        """Submit on one ``SubmitStream`` (one ack per trajectory); backpressured ones are retried."""
        order = todo = list(trajs)
        if self.session_id is None:
            self.register()
        results: dict[int, SubmitResult] = {}
        delays, start = self.backoff.delays(), time.monotonic()
        while todo:
            send, payloads = [], []
            for t in todo:
                data = self._wire_bytes(t)
                if isinstance(data, SubmitResult):
                    results[id(t)] = data
                else:
                    send.append(t)
                    payloads.append(data)
            retry: list[pb.Trajectory | EncodedTrajectory] = []
            try:
                acks = self._submit_stream(iter(payloads), timeout=self.rpc_timeout_s * max(1, len(send)),
                                           metadata=self._metadata)
                for t, ack in zip(send, acks, strict=False):
                    code = _CODES.get(ack.code, grpc.StatusCode.UNKNOWN)
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        retry.append(t)
                    else:
                        results[id(t)] = SubmitResult(ack.task_id, ack.sample_index, code, ack.reason,
                                                      ack.duplicate)
                        if code == grpc.StatusCode.NOT_FOUND:
                            self._forget_session()
            except grpc.RpcError as e:
                if not is_retryable(e):
                    for t in send:
                        results.setdefault(id(t), SubmitResult(t.task_id, t.sample_index, e.code(),
                                                               e.details() or ""))
                    break
                retry = [t for t in send if id(t) not in results]  # unacked: resend (idempotent)
            todo = retry
            if todo:
                try:
                    self._sleep(delays, start, "submit_many", BackpressureSignal())
                except RolloutError as gave_up:
                    for t in todo:
                        results[id(t)] = SubmitResult(t.task_id, t.sample_index, gave_up.code,
                                                      gave_up.details)
                    break
        return [results[id(t)] for t in order]

    # ---------------------------------------------------------------- weights

    def watch_weights(self, after_version: int = -1) -> Iterator[pb.WeightVersion]:
        """Published weight versions newer than ``after_version``, forever; reconnects as needed.

        Ends only when the client is closed.
        """
        delays, start = self.backoff.delays(), time.monotonic()
        after = after_version
        while not self._closed.is_set():
            try:
                if self.session_id is None:
                    self._register_once()
                stream = self._stub.WatchWeights(
                    pb.WatchWeightsRequest(session_id=self.session_id, after_version=after),
                    metadata=self._metadata)
                for wv in stream:
                    delays, start = self.backoff.delays(), time.monotonic()  # healthy again
                    after = max(after, wv.version)
                    yield wv
                    if self._closed.is_set():
                        stream.cancel()
                        return
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self._forget_session()
                    after = -1  # a restarted trainer numbers its versions anew; the caller filters
                    continue
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise RolloutError(e.code(), e.details() or "") from None
                try:
                    self._sleep(delays, start, "watch_weights", e)
                except RolloutError:
                    return

    def fetch_file(self, version: int, fmt: str, rel: str, dest: Path, size: int, sha256: str, *,
                   have_version: int | None = None) -> None:
        """Download one manifest file into ``dest`` (resuming a partial file), checking size and sha256.

        ``have_version``: the version of ``fmt`` this sampler holds (-1: none); ``rel`` then names
        a file as stored (a delta's blob, listed in a ``WeightStep``)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        delays, start = self.backoff.delays(), time.monotonic()
        while True:
            offset = dest.stat().st_size if dest.exists() else 0
            if offset > size:
                dest.unlink()
                offset = 0
            try:
                if offset < size:
                    self._download(version, fmt, rel, dest, offset, size, have_version)
                break
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND and "session" in (e.details() or ""):
                    self._forget_session()
                    self.register()
                    continue
                if e.code() not in RETRYABLE:
                    raise WeightsError(f"fetching {rel} of version {version}: {e.code().name} "
                                       f"{e.details()}") from None
                self._sleep(delays, start, f"fetch {rel}", e)
        dest.touch()  # an empty file is never downloaded: make it exist for the check
        check_downloaded(dest, rel, version, fmt, size, sha256)

    def _download(self, version: int, fmt: str, rel: str, dest: Path, offset: int, size: int,
                  have_version: int | None = None) -> None:
        req = pb.FetchWeightsRequest(session_id=self.session_id, version=version, format=fmt, path=rel,
                                     offset=offset, have_version=have_version)
        timeout = max(self.rpc_timeout_s, size / 20e6)
        with open(dest, "ab") as f:
            for chunk in self._stub.FetchWeights(req, timeout=timeout, metadata=self._metadata):
                if chunk.offset != f.tell():
                    raise WeightsError(f"{rel}: chunk at offset {chunk.offset}, expected {f.tell()}")
                f.write(chunk.data)

    def materialize_weights(self, wv: pb.WeightVersion, cache_dir: str | os.PathLike,
                            transfer: str = "auto") -> tuple[str, Path]:
        """A verified local directory for version ``wv`` in the first of our formats it offers.

        ``transfer``: ``shared`` uses the trainer's path (a shared filesystem), ``fetch`` downloads
        over gRPC into ``cache_dir``, ``auto`` uses the path if it exists here, else fetches.
        Every file is checked against the published sha256 manifest either way; any problem
        raises ``WeightsError`` and nothing is returned (the caller keeps its current weights).
        A version published as a delta is built from the last version materialized here.
        """
        key = str(self.server_id)
        if key != self._held_key:  # a restarted trainer numbers versions anew: hold nothing of it
            self._held, self._held_key = {}, key
        fmt, path = materialize_weights(
            wv, cache_dir, formats=self.weight_formats, fetch_file=self.fetch_file, cache_key=key,
            transfer=transfer, held=self._held, log=lambda m: log.warning("weights v%d: %s", wv.version, m))
        previous = self._held.get(fmt)
        self._held[fmt] = (wv.version, path)
        # Keep the new directory and the one before (the engine may still read it until it swaps).
        prune_cache(cache_dir, key, fmt, [path] + ([previous[1]] if previous else []))
        return fmt, path
