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
  load them (``materialize_weights``).

No torch here: an external sampler needs only this module, ``mixrl_wire`` and numpy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import grpc
import numpy as np

from mixrl_wire import BULK_CHANNEL_OPTIONS, SERVICE_NAME, pb, pb_grpc
from mixrl_wire import encoder as wire
from mixrl_wire.arrays import encode

log = logging.getLogger("mixrl.client")

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
_OK = grpc.StatusCode.OK
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class RolloutError(RuntimeError):
    """A call failed for good (not retried, or out of retry time): ``code`` says why."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class WeightsError(RuntimeError):
    """Published weights could not be obtained or failed verification; keep the old ones."""


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


def _is_size_error(e: grpc.RpcError) -> bool:
    # gRPC reports an over-limit message as RESOURCE_EXHAUSTED too; it must not be retried.
    return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (e.details() or "")


class RolloutClient:
    """A session with one trainer. Thread-safe: the sampler loop, its heartbeat and its weights
    watcher share one client (one channel)."""

    def __init__(self, address: str, token: str, *, group: str, recipe: pb.Recipe | Mapping | str = "bf16",
                 accelerator: str = "", capacity: int = 1, weight_formats: Sequence[str] = ("bf16",),
                 name: str | None = None, tls: TLSOptions | None = None,
                 max_message_bytes: int = 64 * 1024**2, backoff: Backoff = Backoff(),
                 rpc_timeout_s: float = 30.0, max_retry_s: float | None = None):
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
        self.capacity = capacity
        self.weight_formats = tuple(weight_formats)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.backoff = backoff
        self.rpc_timeout_s = rpc_timeout_s
        self.max_retry_s = max_retry_s
        self.max_message_bytes = max_message_bytes
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.session_id: str | None = None
        self.server_id: str | None = None
        self.info: pb.RegisterResponse | None = None
        self.registrations = 0
        self.expired_leases: set[str] = set()
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
        if tls is not None:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            read = lambda p: Path(p).read_bytes() if p else None
            creds = grpc.ssl_channel_credentials(root_certificates=read(tls.ca_file),
                                                 private_key=read(tls.key_file),
                                                 certificate_chain=read(tls.cert_file))
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
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
        self._channel.close()

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
                if code in _RETRYABLE and not _is_size_error(e):
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
                                     name=self.name)
            resp = self._stub.Register(req, timeout=self.rpc_timeout_s, metadata=self._metadata)
            if self.server_id is not None and resp.server_id != self.server_id:
                log.warning("trainer restarted (server %s -> %s); new session", self.server_id,
                            resp.server_id)
            self.info, self.session_id, self.server_id = resp, resp.session_id, resp.server_id
            self.registrations += 1
            if resp.max_message_bytes:
                self.max_message_bytes = min(self.max_message_bytes, resp.max_message_bytes)
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
            size = _size_bound(traj)  # refuse a huge message before serializing it
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
                if code in _RETRYABLE and not _is_size_error(e) and not self._closed.is_set():
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
                if e.code() not in _RETRYABLE or _is_size_error(e):
                    for t in send:
                        results.setdefault(id(t), SubmitResult(t.task_id, t.sample_index, e.code(),
                                                               e.details() or ""))
                    break
                retry = [t for t in send if id(t) not in results]  # unacked: resend (idempotent)
            todo = retry
            if todo:
                try:
                    self._sleep(delays, start, "submit_many", _Pseudo(grpc.StatusCode.RESOURCE_EXHAUSTED))
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

    def fetch_file(self, version: int, fmt: str, rel: str, dest: Path, size: int, sha256: str) -> None:
        """Download one manifest file into ``dest`` (resuming a partial file), checking size and sha256."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        delays, start = self.backoff.delays(), time.monotonic()
        while True:
            offset = dest.stat().st_size if dest.exists() else 0
            if offset > size:
                dest.unlink()
                offset = 0
            try:
                if offset < size:
                    self._download(version, fmt, rel, dest, offset, size)
                break
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND and "session" in (e.details() or ""):
                    self._forget_session()
                    self.register()
                    continue
                if e.code() not in _RETRYABLE:
                    raise WeightsError(f"fetching {rel} of version {version}: {e.code().name} "
                                       f"{e.details()}") from None
                self._sleep(delays, start, f"fetch {rel}", e)
        dest.touch()
        got = dest.stat().st_size
        if got != size or sha256_file(dest) != sha256:
            dest.unlink(missing_ok=True)
            raise WeightsError(f"{rel} of version {version} ({fmt}): "
                               + (f"size {got}, the manifest says {size}" if got != size
                                  else "sha256 does not match the manifest (corrupt)"))

    def _download(self, version: int, fmt: str, rel: str, dest: Path, offset: int, size: int) -> None:
        req = pb.FetchWeightsRequest(session_id=self.session_id, version=version, format=fmt, path=rel,
                                     offset=offset)
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
        """
        locations = {loc.format: loc for loc in wv.locations}
        fmt = next((f for f in self.weight_formats if f in locations), None)
        if fmt is None:
            raise WeightsError(f"version {wv.version} offers formats {sorted(locations)}, "
                               f"this sampler takes {list(self.weight_formats)}")
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
        final = Path(cache_dir) / f"{self.server_id}-v{wv.version:08d}" / fmt
        if final.is_dir() and not verify_files(final, files):
            return fmt, final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{fmt}.part-", dir=final.parent))
        try:
            for rel, (size, sha) in sorted(files.items()):
                _check_rel(rel)
                self.fetch_file(wv.version, fmt, rel, tmp / rel, size, sha)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return fmt, final


_ARRAY_FIELDS = ("token_ids", "loss_mask", "logprobs", "logprobs_full", "versions", "head_ids",
                 "head_logprobs", "support_indptr", "support_ids", "support_logprobs")


def _size_bound(traj: pb.Trajectory) -> int:
    """An upper bound of the serialized size, without ``ByteSize()`` (as slow as serializing).

    Array payloads and strings are exact; 1 KiB covers every tag, length prefix, shape and scalar.
    """
    return (1024 + sum(len(getattr(traj, f).data) for f in _ARRAY_FIELDS) + len(traj.session_id)
            + len(traj.lease_id) + len(traj.finish_reason.encode()))


class _Pseudo(grpc.RpcError):
    """A stand-in error for ``_sleep`` when the stream itself succeeded but asked us to back off."""

    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "backpressure"


def _check_rel(rel: str) -> None:
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts:
        raise WeightsError(f"manifest path {rel!r} escapes the weights directory")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 * 1024 * 1024)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def verify_files(root: str | os.PathLike, files: Mapping[str, tuple[int, str]]) -> list[str]:
    """Problems of ``root`` against ``{relative path: (size, sha256)}``, each naming the file."""
    root = Path(root)
    problems = []
    for rel, (size, sha) in sorted(files.items()):
        try:
            _check_rel(rel)
        except WeightsError as e:
            problems.append(str(e))
            continue
        path = root / rel
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != size:
            problems.append(f"{path}: size {path.stat().st_size} bytes, the manifest says {size}")
        elif sha256_file(path) != sha:
            problems.append(f"{path}: sha256 does not match the manifest (corrupt)")
    return problems


# ------------------------------------------------------------------------------------------------
# Building trajectories


def _support_csr(support_ids, support_logprobs, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR (indptr, ids, logprobs) from ragged rows or from rows padded with -1 ids / -inf logprobs."""
    if isinstance(support_ids, np.ndarray) and support_ids.ndim == 2:
        ids = np.asarray(support_ids)
        lps = np.asarray(support_logprobs, dtype=np.float32)
        keep = ids >= 0
        lengths = keep.sum(axis=1)
        return (np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
                ids[keep].astype(np.int32), lps[keep])
    rows_ids = [np.asarray(r) for r in support_ids]
    rows_lps = [np.asarray(r, dtype=np.float32) for r in support_logprobs]
    if len(rows_ids) != n:
        raise ValueError(f"support has {len(rows_ids)} rows for {n} policy tokens")
    keep = [r >= 0 for r in rows_ids]  # tolerate padded rows given as a list too
    ids = [r[k] for r, k in zip(rows_ids, keep, strict=True)]
    lps = [r[k] for r, k in zip(rows_lps, keep, strict=True)]
    lengths = np.array([len(r) for r in ids], dtype=np.int64)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cat = lambda rows, dt: np.concatenate(rows).astype(dt) if rows else np.zeros(0, dt)
    return indptr, cat(ids, np.int32), cat(lps, np.float32)


def build_trajectory(task: pb.Task, sample_index: int, *, token_ids, logprobs, logprobs_full, versions,
                     head_ids, head_logprobs, loss_mask=None, support_ids=None, support_logprobs=None,
                     reward: float | None = None, finish_reason: str = "", queue_ms: float = 0.0,
                     generate_ms: float = 0.0) -> pb.Trajectory:
    """A ``Trajectory`` message for sample ``sample_index`` of a leased ``task``.

    ``token_ids``: all tokens after the prompt; ``loss_mask`` (default: all policy tokens) marks
    which the policy generated, and the per-token arrays are aligned with those. ``support_*``:
    only when the task's sampling truncates; ragged rows, or rows padded with -1 / -inf.
    """
    tokens = np.asarray(token_ids, dtype=np.int32)
    mask = np.ones(tokens.shape, np.uint8) if loss_mask is None else np.asarray(loss_mask, dtype=np.uint8)
    msg = pb.Trajectory(lease_id=task.lease_id, task_id=task.task_id, sample_index=sample_index,
                        finish_reason=finish_reason,
                        timings=pb.Timings(queue_ms=queue_ms, generate_ms=generate_ms))
    encode(tokens, "int32", msg.token_ids)
    encode(mask, "uint8", msg.loss_mask)
    encode(logprobs, "float32", msg.logprobs)
    encode(logprobs_full, "float32", msg.logprobs_full)
    encode(versions, "int32", msg.versions)
    encode(head_ids, "int32", msg.head_ids)
    encode(head_logprobs, "float32", msg.head_logprobs)
    if support_ids is not None:
        indptr, ids, lps = _support_csr(support_ids, support_logprobs, int(mask.sum()))
        encode(indptr, "int32", msg.support_indptr)
        encode(ids, "int32", msg.support_ids)
        encode(lps, "float32", msg.support_logprobs)
    if reward is not None:
        msg.reward = float(reward)
    return msg


@dataclasses.dataclass(frozen=True)
class EncodedTrajectory:
    """A ``Trajectory`` already serialized (``encode_trajectory``): submitted without re-encoding.

    ``data`` is the message for ``session_id``; ``for_session`` rewrites only that leading field
    when the client's session changed (a re-registration) since it was encoded.
    """

    task_id: int
    sample_index: int
    data: bytes
    session_id: str = ""

    def for_session(self, session_id: str) -> bytes:
        """The wire bytes with ``session_id`` (field 1, which the encoder writes first)."""
        if session_id == self.session_id:
            return self.data
        old = len(wire.string_field(1, self.session_id))
        return wire.string_field(1, session_id) + memoryview(self.data)[old:]

    def to_message(self) -> pb.Trajectory:
        """The same trajectory as a protobuf message (for inspection; not on the hot path)."""
        return pb.Trajectory.FromString(self.data)

    def __len__(self) -> int:
        return len(self.data)


def _wire_array(values, dtype: str) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<"))


def encode_trajectory(task: pb.Task, sample_index: int, *, token_ids, logprobs, logprobs_full, versions,
                      head_ids, head_logprobs, loss_mask=None, support_ids=None, support_logprobs=None,
                      reward: float | None = None, finish_reason: str = "", queue_ms: float = 0.0,
                      generate_ms: float = 0.0, session_id: str = "") -> EncodedTrajectory:
    """``build_trajectory``'s trajectory written straight to the wire format from numpy arrays.

    Same arguments and the same message (``pb.Trajectory.FromString(encoded.data)`` equals what
    ``build_trajectory`` returns, with ``session_id`` set), without protobuf ``Array`` objects or
    a serialization pass: each array is copied once. Pass the client's ``session_id`` to save the
    copy that ``submit`` otherwise makes to insert it.
    """
    tokens = _wire_array(token_ids, "int32")
    mask = np.ones(tokens.shape, np.uint8) if loss_mask is None else _wire_array(loss_mask, "uint8")
    arrays = {"token_ids": tokens, "loss_mask": mask, "logprobs": _wire_array(logprobs, "float32"),
              "logprobs_full": _wire_array(logprobs_full, "float32"),
              "versions": _wire_array(versions, "int32"), "head_ids": _wire_array(head_ids, "int32"),
              "head_logprobs": _wire_array(head_logprobs, "float32")}
    if support_ids is not None:
        indptr, ids, lps = _support_csr(support_ids, support_logprobs, int(mask.sum()))
        arrays.update(support_indptr=_wire_array(indptr, "int32"), support_ids=_wire_array(ids, "int32"),
                      support_logprobs=_wire_array(lps, "float32"))
    data = wire.encode_trajectory(session_id=session_id, lease_id=task.lease_id, task_id=task.task_id,
                                  sample_index=sample_index, arrays=arrays,
                                  reward=None if reward is None else float(reward),
                                  finish_reason=finish_reason, timings=(float(queue_ms), float(generate_ms)))
    return EncodedTrajectory(task.task_id, sample_index, data, session_id)
