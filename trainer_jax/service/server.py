"""The rollout service: gRPC server, scheduler, buffer, weights registry, health and reflection.

The Python API the training loop uses::

    service = RolloutService(cfg.service, source, token=token, vocab_size=V).start()
    groups = service.buffer.take_groups(n, timeout=30.0)          # validated, grouped by prompt
    service.publish_version(7, {"bf16": dir_bf16, "fp8_block": dir_fp8})   # samplers follow
    service.status()                                              # metrics dict (router, samplers)
    service.stop()

Submissions go through ``_submit``: lease checks (scheduler) -> content validation -> trainer-side
reward -> commit, each step able to refuse with a status code and a reason naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Mapping
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mixrl_wire import BULK_CHANNEL_OPTIONS, SERVICE_NAME, pb, pb_grpc
from mixrl_wire.fastpath import WireTrajectory, decode_trajectory
from mixrl_wire.probe import Probe
from trainer_jax.config import RunConfig, ServiceConfig
from trainer_jax.cost import accelerator_mismatch
from trainer_jax.service.auth import BearerTokenInterceptor, server_credentials
from trainer_jax.service.buffer import TrajectoryGroup
from trainer_jax.service.probes import RECORD_DIR, ProbeBook
from trainer_jax.service.router import Router
from trainer_jax.service.scheduler import Duplicate, Rejected, Scheduler
from trainer_jax.service.scoring import ScoringBuffer
from trainer_jax.service.sessions import describe_device
from trainer_jax.service.status import status_response
from trainer_jax.service.tasks import TaskSource, TaskSpec, build_task_source
from trainer_jax.service.validation import MAX_ABS_REWARD, ValidationError, validate_trajectory
from trainer_jax.service.weights import WeightRegistry

log = logging.getLogger("mixrl.service")
_OK = grpc.StatusCode.OK.value[0]


def _code(code: grpc.StatusCode) -> int:
    return code.value[0]


class _Servicer(pb_grpc.RolloutServicer):
    """gRPC glue: every method maps scheduler/registry outcomes to status codes."""

    def __init__(self, service: RolloutService):
        self.svc = service
        self._mismatches: set[tuple[str, str]] = set()  # (group, accelerator problem) warned once

    def Register(self, request, context):
        try:
            s = self.svc.scheduler.register(request, context.peer())
        except Rejected as e:
            context.abort(e.code, str(e))
        cfg = self.svc.cfg
        log.info("registered %s (group %s, recipe %s, capacity %d, %s) from %s", s.name, s.group,
                 s.recipe.get("name"), s.capacity, describe_device(s.device, s.recipe.get("name")),
                 s.peer)
        if problem := accelerator_mismatch(self.svc.accelerators.get(s.group), s.accelerator, s.device):
            # Never refused; said once per group and device (a fleet of 100 replicas on the wrong
            # card is one line, at warning level; later ones at info).
            first = (s.group, problem) not in self._mismatches
            self._mismatches.add((s.group, problem))
            log.log(logging.WARNING if first else logging.INFO, "sampler %s (group %s): %s%s", s.name,
                    s.group, problem, "" if first else " (said before for this group)")
        return pb.RegisterResponse(
            session_id=s.id, server_id=self.svc.server_id,
            heartbeat_interval_ms=int(cfg.heartbeat_s * 1000), session_ttl_ms=int(cfg.session_ttl_s * 1000),
            max_outstanding=self.svc.scheduler.max_outstanding(s),
            max_message_bytes=cfg.limits.max_message_bytes, vocab_size=self.svc.vocab_size,
            current_version=self.svc.scheduler.current_version,
            partial_rollouts=self.svc.partial_rollouts,
            envs=[pb.EnvSpec(**e) for e in getattr(self.svc.source, "env_specs", ())])

    def Lease(self, request, context):
        try:
            return self.svc.scheduler.lease(request)
        except Rejected as e:
            context.abort(e.code, str(e))

    def Heartbeat(self, request, context):
        try:
            return self.svc.scheduler.heartbeat(request)
        except Rejected as e:
            context.abort(e.code, str(e))

    def Submit(self, request, context):
        ack = self.svc._submit(request)
        if ack.code != _OK:
            context.abort(_CODES[ack.code], ack.reason)
        return ack

    def SubmitStream(self, request_iterator, context):
        for request in request_iterator:
            yield self.svc._submit(request)

    def WatchWeights(self, request, context):
        sched = self.svc.scheduler
        try:
            sched.touch(request.session_id)
        except Rejected as e:
            context.abort(e.code, str(e))
        after = request.after_version
        while context.is_active() and not self.svc._stopping.is_set():
            pv = self.svc.weights.wait_newer(after, timeout=0.5)
            if pv is not None:
                yield pv.to_pb()
                after = pv.version
            # A stream outliving its session would hide a service restart from the sampler.
            s = sched.sessions.get(request.session_id)
            if s is None:
                context.abort(grpc.StatusCode.NOT_FOUND, "session_id: session expired (register again)")
            if s.revoked:
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"session_id: session revoked: {s.revoked_reason}")

    def FetchWeights(self, request, context):
        try:
            self.svc.scheduler.touch(request.session_id)
        except Rejected as e:
            context.abort(e.code, str(e))
        try:
            path, size = self.svc.weights.file(request.version, request.format, request.path,
                                               stored=request.HasField("have_version"))
        except KeyError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        if not 0 <= request.offset <= size:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, f"offset: {request.offset} outside [0, {size}]")
        try:
            for offset, data in WeightRegistry.read_chunks(path, request.offset):
                yield pb.WeightChunk(offset=offset, data=data)
        except OSError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"path: cannot read {request.path} ({e.strerror})")

    def Status(self, request, context):
        return self.svc.status_pb()

    def ReturnLease(self, request, context):
        try:
            return self.svc.scheduler.return_lease(request)
        except Rejected as e:
            context.abort(e.code, str(e))

    def ReportProbe(self, request, context):
        try:
            return self.svc.report_probe(request)
        except Rejected as e:
            context.abort(e.code, str(e))


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _add_servicer(servicer: _Servicer, server: grpc.Server) -> None:
    """``add_RolloutServicer_to_server``, except that Submit and SubmitStream receive raw bytes.

    The submit path decodes trajectories itself without copying their arrays
    (``mixrl_wire.fastpath``); every other method uses the generated (de)serializers.
    """
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Rollout"].methods:
        req = getattr(pb, method.input_type.name)
        resp = getattr(pb, method.output_type.name)
        raw = method.name in ("Submit", "SubmitStream")
        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[
            (method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(getattr(servicer, method.name),
                                     request_deserializer=None if raw else req.FromString,
                                     response_serializer=resp.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class RolloutService:
    """The trainer-side rollout service; see the module docstring for the API."""

    def __init__(self, cfg: ServiceConfig, source: TaskSource, *, token: str, vocab_size: int,
                 listen: str | None = None):
        if cfg.buffer.max_trajectories < 1:
            raise ValueError("service.buffer.max_trajectories must be >= 1")
        self.cfg = cfg
        self.source = source
        self.token = token
        self.accelerators: dict[str, str | None] = {}  # group -> its priced accelerator (from_config)
        self.vocab_size = int(vocab_size)
        self.listen = listen or cfg.listen
        self.server_id = f"{int(time.time()):x}-{threading.get_native_id():x}-{id(self) & 0xffff:x}"
        # Slow trainer-side rewards are scored off the RPC threads (trainer_jax.service.scoring).
        self.buffer = ScoringBuffer(cfg.buffer.max_trajectories, cfg.buffer.max_bytes, source=source,
                                    max_abs_reward=cfg.limits.max_abs_reward)
        self.router = Router(cfg.router)
        self.scheduler = Scheduler(source, self.buffer, self.router, cfg, self.vocab_size)
        self.weights = WeightRegistry()
        self.probes = ProbeBook(cfg.probe)
        self.port: int | None = None
        self._server: grpc.Server | None = None
        self._health = health.HealthServicer(experimental_non_blocking=True)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = time.monotonic()
        self.dropped_groups = 0
        self.dropped_trajectories = 0
        self.partial_rollouts = True  # train.partial_rollouts, told to samplers at registration

    # ---------------------------------------------------------------- lifecycle

    @property
    def address(self) -> str:
        host = self.listen.rpartition(":")[0]
        return f"{host}:{self.port}"

    def start(self) -> RolloutService:
        limits = self.cfg.limits
        options = [
            ("grpc.max_receive_message_length", limits.max_message_bytes),
            ("grpc.max_send_message_length", limits.max_message_bytes),
            # Never share a port with another process silently (gRPC's default allows it).
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            *BULK_CHANNEL_OPTIONS,
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
            ("grpc.http2.max_ping_strikes", 0),
        ]
        auth = BearerTokenInterceptor(self.token, on_reject=self._count_unauthenticated)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.cfg.max_workers,
                                                        thread_name_prefix="mixrl-rpc"),
                             interceptors=[auth], options=options,
                             maximum_concurrent_rpcs=limits.max_concurrent_rpcs)
        _add_servicer(_Servicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        creds = server_credentials(self.cfg.tls)
        try:
            port = (server.add_secure_port(self.listen, creds) if creds is not None
                    else server.add_insecure_port(self.listen))
        except RuntimeError as e:  # grpc raises on bind failure in recent versions
            raise OSError(f"cannot listen on {self.listen}: {e}") from None
        if not port:
            raise OSError(f"cannot listen on {self.listen}")
        self.port = port
        server.start()
        self._server = server
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._spawn(self._reaper, "mixrl-reaper")
        log.info("rollout service %s listening on %s (%s)", self.server_id, self.address,
                 "mTLS" if self.cfg.tls.client_ca_file else "TLS" if self.cfg.tls.enabled else "plaintext")
        return self

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _reaper(self) -> None:
        period = min(0.2, self.cfg.session_ttl_s / 5)
        while not self._stopping.wait(period):
            self.scheduler.expire()

    def start_drain(self) -> None:
        """Take and drop complete groups as they arrive (``mixrl-train serve``: count, don't train)."""

        def drain() -> None:
            while not self._stopping.is_set():
                groups = self.buffer.take_groups(1024, timeout=0.05)
                self.dropped_groups += len(groups)
                self.dropped_trajectories += sum(len(g.trajectories) for g in groups)

        self._spawn(drain, "mixrl-drain")

    def stop(self, grace: float = 1.0) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._health.enter_graceful_shutdown()
        self.weights.close()
        if self._server is not None:
            self._server.stop(grace).wait()
        self.buffer.close()
        for t in self._threads:
            t.join(timeout=2.0)

    def wait(self) -> None:
        if self._server is not None:
            self._server.wait_for_termination()

    def __enter__(self) -> RolloutService:
        return self.start() if self._server is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------- trainer API

    def publish_version(self, version: int, paths: Mapping[str, str | Path],
                        manifests: Mapping[str, Mapping] | None = None,
                        probe: Probe | None = None) -> None:
        """Announce weights ``version`` as ``{format: directory}`` to every watching sampler.

        ``manifests``: per format, a converter manifest dict (``{"files": {rel: {"sha256", "size"}}}``);
        by default the directory's ``manifest.json`` (or one computed here if it has none).
        ``probe``: the version's probe with the trainer's log p (else the ``probe.json`` of a local
        directory with its record: ``ProbeBook.add_from_dir``), what samplers' ``ReportProbe``
        calls are judged against.
        Versions must increase; trajectories may then carry tokens of any version up to this one.
        """
        if probe is not None:
            self.probes.add(probe)
        elif paths and Path(str(next(iter(paths.values())))).is_dir():
            self.probes.add_from_dir(version, next(iter(paths.values())))
        self.weights.publish(version, paths, manifests)
        self.scheduler.set_version(version)
        log.info("published weights version %d (%s)", version, ", ".join(paths))

    def evaluate(self, specs: list[TaskSpec], timeout: float) -> list[TrajectoryGroup]:
        """Run evaluation tasks through the fleet; their complete groups, in order (blocks).

        Raises ``TimeoutError`` if they are not all in within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        ids = self.scheduler.add_evaluation(specs)
        groups = self.scheduler.wait_evaluation(ids, timeout)
        self.buffer.wait_scored(groups, max(0.0, deadline - time.monotonic()))
        return groups

    def status(self) -> dict:
        """Everything a dashboard or the training loop's metrics want, as plain data."""
        snap = self.scheduler.snapshot()
        snap["buffer"] = self.buffer.snapshot()
        snap["server_id"] = self.server_id
        snap["uptime_s"] = time.monotonic() - self._started
        snap["dropped_groups"] = self.dropped_groups
        snap["dropped_trajectories"] = self.dropped_trajectories
        return snap

    def report_probe(self, req: pb.ProbeReport) -> pb.ProbeAck:
        """Judge a sampler's probe report (``trainer_jax.service.probes``); revoke if it says so."""
        s = self.scheduler.touch(req.session_id)
        if len(req.logprobs) + len(req.previous_logprobs) > 1 << 16:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "logprobs", "probe report too large")
        with self.scheduler.lock:
            action, reason = self.probes.report(s, req)
        if action == pb.ProbeAck.REVOKED:
            log.error("revoking sampler %s (group %s): %s", s.name, s.group, reason)
            self.scheduler.revoke(s.id, reason)
        elif action == pb.ProbeAck.RELOAD:
            log.warning("sampler %s (group %s) asked to reload: %s", s.name, s.group, reason)
        st = s.probe
        return pb.ProbeAck(action=action, reason=reason, verdict=st.verdict, kl=st.kl,
                           max_abs=st.max_abs)

    def status_pb(self) -> pb.StatusResponse:
        """``status()`` as the wire's ``StatusResponse`` (``trainer_jax.service.status``)."""
        return status_response(self)

    # ---------------------------------------------------------------- internals

    def _count_unauthenticated(self, method: str) -> None:
        with self.scheduler.lock:
            self.scheduler.totals["unauthenticated"] += 1

    def _submit(self, msg: bytes | pb.Trajectory | WireTrajectory) -> pb.SubmitAck:
        """One submission end to end; never raises (the ack carries the outcome).

        ``msg``: the serialized ``Trajectory`` as received (decoded here without copying its
        arrays), or an already decoded message.
        """
        if isinstance(msg, bytes | bytearray | memoryview):
            try:
                msg = decode_trajectory(msg)
            except DecodeError as e:
                return pb.SubmitAck(code=_code(grpc.StatusCode.INVALID_ARGUMENT),
                                    reason=f"message: not a valid mixrl.v1.Trajectory ({e})")
        ack = pb.SubmitAck(task_id=msg.task_id, sample_index=msg.sample_index)
        sched = self.scheduler
        try:
            session, spec, ctx = sched.begin_submit(msg)
            if self.cfg.limits.max_abs_reward != MAX_ABS_REWARD:  # a reward or part beyond it: refused
                ctx = dataclasses.replace(ctx, max_abs_reward=self.cfg.limits.max_abs_reward)
            try:
                record = validate_trajectory(msg, ctx)
            except ValidationError as e:
                sched.count_rejection(msg.session_id, e.field)
                ack.code, ack.reason = _code(grpc.StatusCode.INVALID_ARGUMENT), str(e)
                return ack
            if self.buffer.scores_slowly(spec):
                self._commit_then_score(msg, record, session, spec)
            else:  # an in-process check of the tokens (or none): as cheap as the validation
                score = self.source.score(spec, record)
                if score is not None:
                    record.reward = float(score)
                sched.finish_submit(msg, record, session)
        except Duplicate:
            ack.duplicate = True
        except Rejected as e:
            if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                sched.count_rejection(msg.session_id, e.field)
            ack.code, ack.reason = _code(e.code), str(e)
        except Exception as e:  # a bug must not take the stream down with it
            log.exception("submit failed")
            ack.code, ack.reason = _code(grpc.StatusCode.INTERNAL), f"internal error: {type(e).__name__}"
        return ack

    def _commit_then_score(self, msg, record, session, spec: TaskSpec) -> None:
        """Commit a sample whose reward takes a worker call, and score it on a scoring thread:
        the RPC thread never waits for a reward function (``ScoringBuffer``)."""
        if not self.buffer.hold(record):
            with self.scheduler.lock:
                self.scheduler.totals["backpressure"] += 1
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, "",
                           f"{self.buffer.capacity} samples wait for their rewards: retry later")
        try:
            self.scheduler.finish_submit(msg, record, session)
        except BaseException:
            self.buffer.release(record)
            raise
        self.buffer.score_later(spec, record)

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_config(cls, cfg: RunConfig, *, token: str, listen: str | None = None,
                    source: TaskSource | None = None) -> RolloutService:
        """Build (not start) the service a run config describes: tasks from ``cfg.tasks``."""
        if source is None:
            from convert.tokenizer import char_tokenizer, load_tokenizer

            tokenizer_dir = cfg.model.hf_dir or _tokenizer_dir(cfg.service.weights_dir)
            source = build_task_source(cfg.tasks, tokenizer=load_tokenizer(tokenizer_dir) if tokenizer_dir
                                       else char_tokenizer())
        vocab = cfg.service.vocab_size or _weights_vocab(cfg.service.weights_dir) or getattr(
            source, "vocab_size", None)
        if vocab is None:
            raise ValueError("service.vocab_size: cannot infer the vocabulary size (no weights_dir, and the "
                             "task source has no tokenizer); set it")
        svc = cls(cfg.service, source, token=token, vocab_size=vocab, listen=listen)
        svc.scheduler.max_support = cfg.train.support_k  # a larger kept set is refused, counted
        svc.router.configure(cfg.group_prices(), cfg.train.max_staleness,  # policy cost's inputs
                             eval_only=[g.name for g in cfg.groups if g.eval_only])
        svc.accelerators = {g.name: g.accelerator for g in cfg.groups}  # checked at registration
        svc.partial_rollouts = cfg.train.partial_rollouts
        # The trainer's probe records (log p, never published): what `serve` judges reports with.
        svc.probes.record_dir = Path(cfg.run.dir) / RECORD_DIR
        return svc


def _weights_vocab(weights_dir: str | None) -> int | None:
    if weights_dir is None:
        return None
    for cfg_path in [Path(weights_dir) / "config.json", *sorted(Path(weights_dir).glob("*/config.json"))]:
        if cfg_path.exists():
            return int(json.loads(cfg_path.read_text())["vocab_size"])
    return None


def _tokenizer_dir(weights_dir: str | None) -> Path | None:
    """The first HF directory under ``weights_dir`` (itself, or a format subdirectory) with a tokenizer."""
    if weights_dir is None:
        return None
    found = [p.parent for p in [Path(weights_dir) / "tokenizer.json",
                                *sorted(Path(weights_dir).glob("*/tokenizer.json"))] if p.exists()]
    return found[0] if found else None


def weight_dirs(weights_dir: str | Path, default_format: str) -> dict[str, Path]:
    """``{format: dir}`` of a weights directory: itself if it is an HF dir, else its HF subdirectories."""
    root = Path(weights_dir)
    if (root / "config.json").exists():
        return {default_format: root}
    found = {p.parent.name: p.parent for p in sorted(root.glob("*/config.json"))}
    if not found:
        from convert.delta import delta_hint

        raise FileNotFoundError(delta_hint(root) or
                                f"{root}: neither an HF directory nor a directory of per-format HF dirs")
    return found
