"""The rollout service over real gRPC on 127.0.0.1: leases, exactly-once submission, auth, bad input,
backpressure, expiry, TLS, weights. Clients run in-process; the wire and the server are real."""

import json
import time

import grpc
import numpy as np
import pytest
from fakes import fake_trajectory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixrl_wire import pb, pb_grpc
from mixrl_wire.arrays import encode
from sampler_torch.client import Backoff, RolloutClient, RolloutError, TLSOptions, WeightsError
from trainer_jax.config import RouterConfig, load_config
from trainer_jax.service import RolloutService, Router
from trainer_jax.service.validation import ValidationError, validate_trajectory

TOKEN = "s3cret-token"
FAST = Backoff(initial_s=0.01, max_s=0.1)
BASE = ["service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.max_new_tokens=8",
        "tasks.sampling.head_k=4", "service.max_workers=16"]


def make_service(*overrides, source=None) -> RolloutService:
    cfg = load_config(None, [*BASE, *overrides])
    return RolloutService.from_config(cfg, token=TOKEN, source=source).start()


@pytest.fixture
def service_factory():
    made = []

    def make(*overrides, **kw):
        svc = make_service(*overrides, **kw)
        made.append(svc)
        return svc

    yield make
    for svc in made:
        svc.stop(grace=0)


def client(svc, group="g", token=TOKEN, **kw) -> RolloutClient:
    kw.setdefault("capacity", 8)
    kw.setdefault("name", f"{group}-{id(kw)}")
    kw.setdefault("max_retry_s", 3.0)
    return RolloutClient(svc.address, token, group=group, backoff=FAST, **kw)


def raw_stub(svc):
    ch = grpc.insecure_channel(svc.address, options=[("grpc.max_send_message_length", 256 * 1024**2)])
    return pb_grpc.RolloutStub(ch), (("authorization", f"Bearer {TOKEN}"),)


def lease_all(c: RolloutClient, n: int, tries: int = 5) -> list[pb.Task]:
    """Lease until ``n`` samples are held or ``tries`` calls came back short."""
    tasks = []
    for _ in range(tries):
        tasks += c.lease(n - sum(len(t.sample_indices) for t in tasks)).tasks
        if sum(len(t.sample_indices) for t in tasks) >= n:
            break
    return tasks


def test_every_sample_accepted_exactly_once_despite_retries(service_factory):
    svc = service_factory("tasks.count=6")
    c = client(svc, capacity=4)
    rng = np.random.default_rng(0)
    submitted = 0
    while True:
        resp = c.lease(4)
        if not resp.tasks:
            assert resp.reason == "no more tasks"
            break
        trajs = [fake_trajectory(t, i, svc.vocab_size, rng) for t in resp.tasks for i in t.sample_indices]
        first = c.submit_many(trajs)
        assert all(r.accepted and not r.duplicate for r in first)
        again = [c.submit(t) for t in trajs]  # a retry after an ambiguous failure
        assert all(r.accepted and r.duplicate for r in again)
        submitted += len(trajs)
    groups = svc.buffer.take_groups(10, timeout=0)
    assert submitted == 12 and sorted(g.task_id for g in groups) == list(range(1, 7))
    for g in groups:
        assert [t.sample_index for t in g.trajectories] == [0, 1]
        assert all(t.reward in (0.0, 1.0) and t.group == "g" and t.recipe["name"] == "bf16"
                   for t in g.trajectories)
    st = svc.status()
    assert st["totals"]["accepted"] == 12 and st["totals"]["duplicates"] == 12
    assert st["buffer"]["held_trajectories"] == 0 and st["outstanding_samples"] == 0
    status = c.status()
    assert status.accepted == 12 and status.taken_groups == 6 and status.samplers[0].accepted == 12


def test_bearer_token_required_except_health_and_reflection(service_factory):
    svc = service_factory()
    ch = grpc.insecure_channel(svc.address)
    stub = pb_grpc.RolloutStub(ch)
    for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
        for call in (lambda md: stub.Register(pb.RegisterRequest(group="g", capacity=1), metadata=md),
                     lambda md: stub.Status(pb.StatusRequest(), metadata=md),
                     lambda md: list(stub.WatchWeights(pb.WatchWeightsRequest(), metadata=md)),
                     lambda md: list(stub.SubmitStream(iter([pb.Trajectory()]), metadata=md))):
            with pytest.raises(grpc.RpcError) as info:
                call(metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    health = health_pb2_grpc.HealthStub(ch)
    for name in ("", "mixrl.v1.Rollout"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
            health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "mixrl.v1.Rollout" in {s.name for s in resp.list_services_response.service}
    assert svc.status()["totals"]["unauthenticated"] == 12
    with pytest.raises(RolloutError) as info:
        client(svc, token="wrong").register()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert svc.status()["samplers"] == []


@pytest.fixture(scope="module")
def hostile_service():
    svc = make_service("tasks.group_size=1", "tasks.sampling.top_p=0.8", "tasks.sampling.top_k=32",
                       "service.limits.max_outstanding_per_sampler=100000")
    c = client(svc, capacity=100000)
    c.register()
    yield svc, c
    c.close()
    svc.stop(grace=0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_malformed_trajectories_rejected_like_the_validator_says(hostile_service, data):
    """Server verdict == local validator verdict; a rejection names the field and changes nothing."""
    svc, c = hostile_service
    task = c.lease(1).tasks[0]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    msg = fake_trajectory(task, 0, svc.vocab_size, rng, n_tokens=data.draw(st.integers(1, 8)))
    field = data.draw(st.sampled_from(["token_ids", "loss_mask", "logprobs", "logprobs_full", "versions",
                                       "head_ids", "head_logprobs", "support_indptr", "support_ids",
                                       "support_logprobs"]))
    arr = getattr(msg, field)
    raw = bytearray(arr.data)
    if raw:
        for _ in range(data.draw(st.integers(1, 3))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    arr.data = bytes(raw)
    if data.draw(st.booleans()):
        arr.shape.append(data.draw(st.integers(0, 2)))
    msg.session_id = c.session_id
    ctx = svc.scheduler.begin_submit(msg)[2]
    try:
        validate_trajectory(msg, ctx)
        expect = None
    except ValidationError as e:
        expect = e.field
    before = (svc.buffer.snapshot(), svc.status()["totals"].get("accepted", 0))
    rejected_before = svc.status()["totals"].get("rejected", 0)
    r = c.submit(msg)
    if expect is None:
        assert r.accepted
        svc.buffer.take_groups(1, timeout=1)
    else:
        assert r.code == grpc.StatusCode.INVALID_ARGUMENT and r.reason.startswith(expect + ":"), r
        assert (svc.buffer.snapshot(), svc.status()["totals"].get("accepted", 0)) == before
        assert svc.status()["totals"]["rejected"] == rejected_before + 1
        sampler = svc.status()["samplers"][0]
        assert sampler["rejections"][expect] >= 1
        # Still serving: the genuine sample for that lease goes through.
        good = fake_trajectory(task, 0, svc.vocab_size, rng)
        assert c.submit(good).accepted
        assert len(svc.buffer.take_groups(1, timeout=1)) == 1


def test_oversized_message_refused_and_service_keeps_serving(service_factory):
    svc = service_factory("service.limits.max_message_bytes=65536")
    c = client(svc)
    task = lease_all(c, 2)[0]
    rng = np.random.default_rng(0)
    big = fake_trajectory(task, 0, svc.vocab_size, rng, n_tokens=8)
    big.finish_reason = "length"
    big.token_ids.data += b""  # keep valid shape; grow an unchecked field instead:
    big.timings.queue_ms = 0
    padded = pb.Trajectory()
    padded.CopyFrom(big)
    encode(np.zeros(40_000, np.int32), "int32", padded.token_ids)  # 160 kB > 64 kB
    stub, md = raw_stub(svc)
    padded.session_id = c.session_id
    with pytest.raises(grpc.RpcError) as info:
        stub.Submit(padded, metadata=md)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    local = c.submit(padded)  # the client refuses locally, without sending
    assert local.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds" in local.reason
    assert svc.buffer.snapshot()["held_trajectories"] == 0
    assert c.submit(big).accepted and svc.status()["totals"]["accepted"] == 1


def test_replays_and_foreign_submissions_rejected(service_factory):
    svc = service_factory("tasks.count=2")
    a, b = client(svc, "a"), client(svc, "b")
    rng = np.random.default_rng(0)
    task = a.lease(2).tasks[0]
    t0 = fake_trajectory(task, 0, svc.vocab_size, rng)
    t1 = fake_trajectory(task, 1, svc.vocab_size, rng)
    assert a.submit(t0).accepted
    held = svc.buffer.snapshot()
    # Another sampler replaying (or stealing) the lease.
    b.register()
    stolen = pb.Trajectory()
    stolen.CopyFrom(t1)
    r = b.submit(stolen)
    assert r.code == grpc.StatusCode.INVALID_ARGUMENT and r.reason.startswith("lease_id: leased to another")
    for field, change in (("task_id", lambda m: setattr(m, "task_id", m.task_id + 1)),
                          ("sample_index", lambda m: setattr(m, "sample_index", 5)),
                          ("lease_id", lambda m: setattr(m, "lease_id", "forged"))):
        m = pb.Trajectory()
        m.CopyFrom(t1)
        change(m)
        r = a.submit(m)
        assert r.code == grpc.StatusCode.INVALID_ARGUMENT and r.reason.startswith(field + ":"), r
    assert svc.buffer.snapshot() == held
    assert a.submit(t1).accepted
    assert svc.buffer.ready_groups == 1
    # The group is complete: a replay is a duplicate (counted once), never a second copy.
    assert a.submit(t1).duplicate and a.submit(t0).duplicate
    replay_b = pb.Trajectory()
    replay_b.CopyFrom(t0)
    assert b.submit(replay_b).code == grpc.StatusCode.INVALID_ARGUMENT
    groups = svc.buffer.take_groups(5, timeout=0)
    assert len(groups) == 1 and len(groups[0].trajectories) == 2
    st = {s["name"]: s for s in svc.status()["samplers"]}
    assert st[a.name]["rejected"] == 3 and st[b.name]["rejections"] == {"lease_id": 2}


def test_silent_sampler_loses_its_leases_to_others(service_factory):
    svc = service_factory("service.session_ttl_s=0.6", "service.heartbeat_s=0.2", "tasks.count=1")
    a, b = client(svc, "a"), client(svc, "b")
    task = a.lease(2).tasks[0]
    assert b.lease(2).tasks == []
    time.sleep(1.0)  # a says nothing: its session expires, the task is re-queued
    again = b.lease(2).tasks
    assert [(t.task_id, list(t.sample_indices)) for t in again] == [(task.task_id, [0, 1])]
    rng = np.random.default_rng(0)
    late = a.submit(fake_trajectory(task, 0, svc.vocab_size, rng))
    assert late.code == grpc.StatusCode.NOT_FOUND  # the lease died with the session
    for i in (0, 1):
        assert b.submit(fake_trajectory(again[0], i, svc.vocab_size, rng)).accepted
    assert len(svc.buffer.take_groups(5, timeout=0)) == 1
    assert svc.status()["totals"]["requeued_samples"] == 2


def test_lease_deadline_requeues_even_while_heartbeating(service_factory):
    svc = service_factory("service.lease_ttl_s=0.4", "tasks.count=1")
    a, b = client(svc, "a"), client(svc, "b")
    task = a.lease(2).tasks[0]
    time.sleep(0.7)
    hb = a.heartbeat()
    assert task.lease_id in hb.expired_lease_ids
    r = a.submit(fake_trajectory(task, 0, svc.vocab_size, np.random.default_rng(0)))
    assert r.code == grpc.StatusCode.INVALID_ARGUMENT and "lease deadline passed" in r.reason
    assert b.lease(2).tasks[0].task_id == task.task_id


def test_backpressure_bounds_the_buffer(service_factory):
    svc = service_factory("service.buffer.max_trajectories=4")
    c = client(svc)
    rng = np.random.default_rng(0)
    tasks = lease_all(c, 4)
    assert sum(len(t.sample_indices) for t in tasks) == 4
    resp = c.lease(4)
    assert not resp.tasks and "buffer full" in resp.reason and resp.retry_after_ms > 0
    for t in tasks:
        for i in t.sample_indices:
            assert c.submit(fake_trajectory(t, i, svc.vocab_size, rng)).accepted
    assert "buffer full" in c.lease(4).reason  # the trainer has not taken anything yet
    assert len(svc.buffer.take_groups(2, timeout=1)) == 2
    assert sum(len(t.sample_indices) for t in c.lease(4).tasks) == 4


def test_byte_bound_answers_resource_exhausted(service_factory):
    svc = service_factory("service.buffer.max_bytes=1000")
    c = client(svc, max_retry_s=0.3)
    task = lease_all(c, 2)[0]
    r = c.submit(fake_trajectory(task, 0, svc.vocab_size, np.random.default_rng(0), env_tokens=300))
    assert r.code == grpc.StatusCode.RESOURCE_EXHAUSTED and svc.buffer.snapshot()["held_bytes"] == 0
    assert svc.status()["totals"]["backpressure"] >= 2  # the client retried with backoff


def test_versions_from_the_future_rejected_until_published(service_factory, tmp_path):
    svc = service_factory()
    c = client(svc)
    task = lease_all(c, 2)[0]
    rng = np.random.default_rng(0)
    future = fake_trajectory(task, 0, svc.vocab_size, rng, version=1)
    r = c.submit(future)
    assert r.code == grpc.StatusCode.INVALID_ARGUMENT and r.reason.startswith("versions:")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "config.json").write_text("{}")
    svc.publish_version(1, {"bf16": tmp_path / "w"})
    assert c.submit(future).accepted
    with pytest.raises(ValueError):
        svc.publish_version(1, {"bf16": tmp_path / "w"})


def test_submit_stream_acks_each_in_order(service_factory):
    svc = service_factory()
    stub, md = raw_stub(svc)
    sid = stub.Register(pb.RegisterRequest(group="g", capacity=4), metadata=md).session_id
    task = stub.Lease(pb.LeaseRequest(session_id=sid, max_samples=2), metadata=md).tasks[0]
    rng = np.random.default_rng(0)
    good = fake_trajectory(task, 0, svc.vocab_size, rng)
    bad = fake_trajectory(task, 1, svc.vocab_size, rng)
    encode(np.full(1, 0.5, np.float32), "float32", bad.logprobs)
    for m in (good, bad):
        m.session_id = sid
    acks = list(stub.SubmitStream(iter([good, good, bad]), metadata=md))
    assert [(a.code, a.duplicate) for a in acks] == [(0, False), (0, True), (3, False)]
    assert acks[2].reason.startswith("logprobs:")


def test_repeat_offender_is_revoked(service_factory):
    svc = service_factory("service.limits.max_rejections_per_sampler=3", "tasks.count=1")
    c = client(svc)
    task = lease_all(c, 2)[0]
    bad = fake_trajectory(task, 0, svc.vocab_size, np.random.default_rng(0))
    encode(np.full(1, np.nan, np.float32), "float32", bad.logprobs)
    for _ in range(3):
        assert c.submit(bad).code == grpc.StatusCode.INVALID_ARGUMENT
    assert c.submit(bad).code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(RolloutError) as info:
        c.lease(2)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert svc.status()["pending_samples"] == 2  # its lease went back to the queue


def test_router_shares_follow_measured_throughput():
    now = [0.0]
    r = Router(RouterConfig(interval_s=1.0, ema_alpha=1.0, min_share=0.1), clock=lambda: now[0])
    for g, n in (("fast", 2), ("slow", 1), ("new", 1)):
        r.group(g).samplers = n
    assert r.shares() == pytest.approx({"fast": 1 / 3, "slow": 1 / 3, "new": 1 / 3})  # nothing measured
    r.record("fast", 300)
    r.record("slow", 100)
    now[0] = 1.0
    shares = r.shares()
    # fast 300 tok/s, slow 100 tok/s, new unmeasured = their mean (200): 3:1:2
    assert shares == pytest.approx({"fast": 0.5, "slow": 1 / 6, "new": 1 / 3})
    assert r.quota("fast", 60, unit=1) == 30 and r.quota("slow", 60, unit=1) == 10
    for _ in range(6):  # "new" stays silent: measured at 0, kept alive by the floor
        now[0] += 1.0
        r.record("fast", 300)
    assert r.shares()["new"] == pytest.approx(0.1) and r.quota("new", 60, unit=2) == 6
    snap = r.snapshot()
    assert snap["fast"]["tokens_per_s"] > 0 and set(snap) == {"fast", "slow", "new"}


def test_router_quota_limits_a_group_and_status_exports_shares(service_factory):
    svc = service_factory("service.router.policy=capacity", "service.router.min_share=0",
                          "service.buffer.max_trajectories=40", "tasks.group_size=1")
    big, small = client(svc, "big", capacity=30), client(svc, "small", capacity=10)
    big.register()
    small.register()
    got_small = lease_all(small, 40)
    got_big = lease_all(big, 40)
    assert sum(len(t.sample_indices) for t in got_small) == 10
    assert sum(len(t.sample_indices) for t in got_big) == 30
    groups = {g.name: g for g in big.status().groups}
    assert groups["big"].share == pytest.approx(0.75) and groups["small"].outstanding == 10


def test_tls_and_mutual_tls(service_factory, tmp_path):
    from certs import make_certs
    certs = make_certs(tmp_path / "certs")
    tls = service_factory(f"service.tls.cert_file={certs['server_cert']}",
                          f"service.tls.key_file={certs['server_key']}")
    ok = client(tls, tls=TLSOptions(ca_file=str(certs["ca"])))
    assert ok.register().session_id
    plain = client(tls, max_retry_s=0.5)
    with pytest.raises(RolloutError):
        plain.register()
    mtls = service_factory(f"service.tls.cert_file={certs['server_cert']}",
                           f"service.tls.key_file={certs['server_key']}",
                           f"service.tls.client_ca_file={certs['ca']}")
    no_cert = client(mtls, tls=TLSOptions(ca_file=str(certs["ca"])), max_retry_s=0.5)
    with pytest.raises(RolloutError):
        no_cert.register()
    with_cert = client(mtls, tls=TLSOptions(ca_file=str(certs["ca"]), cert_file=str(certs["client_cert"]),
                                            key_file=str(certs["client_key"])))
    assert with_cert.register().session_id
    wrong_token = client(mtls, token="nope", tls=TLSOptions(
        ca_file=str(certs["ca"]), cert_file=str(certs["client_cert"]), key_file=str(certs["client_key"])))
    with pytest.raises(RolloutError) as info:
        wrong_token.register()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_weights_fetched_in_chunks_and_verified(service_factory, tmp_path, published):
    from convert.manifest import check_manifest
    v1, v2 = published
    svc = service_factory()
    c = client(svc)
    c.register()
    svc.publish_version(1, v1)
    wv = next(c.watch_weights(after_version=0))
    assert wv.version == 1 and wv.locations[0].format == "bf16"
    listed = {f.path for f in wv.locations[0].manifest.files}
    assert "manifest.json" in listed and "config.json" in listed
    fmt, path = c.materialize_weights(wv, tmp_path / "cache", transfer="fetch")
    assert path.is_relative_to(tmp_path / "cache") and check_manifest(path) == []
    for f in v1["bf16"].iterdir():
        assert (path / f.name).read_bytes() == f.read_bytes()
    assert c.materialize_weights(wv, tmp_path / "cache", transfer="shared")[1] == v1["bf16"].resolve()
    stub, md = raw_stub(svc)
    for bad in ("../init/config.json", "nothing.bin"):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.FetchWeights(pb.FetchWeightsRequest(session_id=c.session_id, version=1, format="bf16",
                                                          path=bad), metadata=md))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    svc.publish_version(2, v2)
    wv2 = next(c.watch_weights(after_version=1))
    for transfer in ("fetch", "shared"):
        with pytest.raises(WeightsError, match="sha256"):
            c.materialize_weights(wv2, tmp_path / "cache", transfer=transfer)
    assert not any("v00000002" in str(p) and p.is_dir() for p in (tmp_path / "cache").rglob("*bf16"))
    assert json.loads((path / "manifest.json").read_text())["files"]
