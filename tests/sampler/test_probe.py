"""The version probe end to end on this machine: the trainer's JAX policy writes probe.json into
published versions, the mixrl engine scores it under each recipe, and the rollout service judges
reports over real gRPC (mixrl_wire.probe, trainer_jax.probe, trainer_jax.service.probes).

The bounds the faults are judged against are the measured ones shipped in
trainer_jax/service/probe_bounds.json (benchmarks/bench_probe.py, same model shape)."""

import importlib.util
import json
import math
import shutil
import sys
import time
from pathlib import Path

import pytest

from mixrl_wire import pb
from mixrl_wire.probe import (
    ABOVE_BOUND,
    OK,
    OLDER,
    UNDECIDED,
    Bound,
    PreviousProbe,
    Probe,
    ProbeError,
    compare,
    flatten,
    judge,
)
from trainer_jax.service.probes import bound_for, load_bounds

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "service"))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_probe", REPO / "benchmarks/bench_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _probe(logp, prev=None) -> Probe:
    prompts = [[1, 2], [3]]
    conts = [[5, 6], [7, 8]]
    return Probe(4, 0, prompts, conts, logp, prev)


def test_probe_json_round_trips_and_malformed_files_name_the_problem():
    prev = PreviousProbe(3, [[9, 9], [9, 9]], [[-1.0, -2.0], [-1.0, -1.0]], [[-1.5, -2.0], [-1, -1]])
    p = _probe([[-0.5, -1.0], [-2.0, -0.1]], prev)
    assert Probe.from_json(json.loads(json.dumps(p.to_json()))) == p
    bad = p.to_json() | {"logprobs": [[-0.5], [-2.0, -0.1]]}
    with pytest.raises(ProbeError, match="shapes differ"):
        Probe.from_json(bad)
    with pytest.raises(ProbeError, match="finite and <= 0"):
        Probe.from_json(p.to_json() | {"logprobs": [[0.5, -1.0], [-2.0, -0.1]]})
    with pytest.raises(ProbeError, match="probe_format"):
        Probe.from_json(p.to_json() | {"probe_format": 99})
    with pytest.raises(ProbeError, match="4 log-probabilities reported for 3"):
        compare([-1.0, -1.0, -1.0], [-1.0] * 4)


def test_judge_tells_older_current_undecided_and_above_bound_apart():
    prev = PreviousProbe(3, [[9, 9], [9, 9]], [[-1.0] * 2, [-1.0] * 2], [[-1.4] * 2, [-1.4] * 2])
    p = _probe([[-0.5, -1.0], [-2.0, -0.1]], prev)
    bound = Bound(kl=1e-3, max_abs=0.1, noise=0.01)
    exact = flatten(p.logprobs)
    # serves this version: its log q of the previous continuation matches log p_v there
    assert judge(p, exact, [-1.4] * 4, bound).verdict == OK
    # serves the previous one: matches log p_{v-1}; separation 0.4 >> 3 x noise
    j = judge(p, exact, [-1.0] * 4, bound)
    assert j.verdict == OLDER and j.separation == pytest.approx(0.4)
    # the two versions closer than margin x noise: cannot tell, says so
    assert judge(p, exact, [-1.0] * 4, Bound(1e-3, 0.1, noise=0.2)).verdict == UNDECIDED
    # far from the trainer's log p on its own tokens: above the bound
    j = judge(p, [x - 0.3 for x in exact], [-1.4] * 4, bound)
    assert j.verdict == ABOVE_BOUND and j.current.max_abs == pytest.approx(0.3)
    assert j.current.kl == pytest.approx(math.exp(-0.3) - 1 + 0.3)  # k3 with log r = -0.3


@pytest.fixture(scope="module")
def outlier_case(tmp_path_factory):
    """Version 0 of the bench's policy with activation outliers, calibrated (floor 0), in every
    format, with its probe."""
    bench = _bench()
    out = tmp_path_factory.mktemp("probe_case")
    (probe,) = bench.build_case(0, out, outliers=True)
    return bench, out, probe


def _kl(bench, out, fmt, recipe, kv, probe):
    return compare(flatten(probe.logprobs), bench.score(bench.version_dir(out, 0, fmt), recipe,
                                                        kv, probe))


def test_probe_kl_orders_recipes_and_catches_forced_scales(outlier_case, tmp_path):
    bench, out, probe = outlier_case
    bounds = load_bounds()
    assert bounds, "trainer_jax/service/probe_bounds.json holds no measured bounds"
    kl = {r: _kl(bench, out, fmt, r, "auto", probe).kl
          for r, fmt in (("bf16", "bf16"), ("fp8", "fp8_block"), ("nvfp4_w4a4", "nvfp4"))}
    assert kl["bf16"] < kl["fp8"] < kl["nvfp4_w4a4"], kl
    # Healthy calibrated exports stay under their measured bounds...
    fp8_bound = bound_for(bounds, "fp8", "mixrl-engine", "cpu")
    nv_bound = bound_for(bounds, "nvfp4_w4a4", "mixrl-engine", "cpu")
    healthy_kv = _kl(bench, out, "fp8_block", "fp8", "fp8_e4m3", probe)
    assert healthy_kv.kl < fp8_bound.kl and healthy_kv.max_abs < fp8_bound.max_abs
    assert kl["nvfp4_w4a4"] < nv_bound.kl
    # ...and the same exports with calibrated scales replaced by 1.0 do not.
    for fmt, suffixes, recipe, kv, bound in (
            ("fp8_block", (".k_scale", ".v_scale"), "fp8", "fp8_e4m3", fp8_bound),
            ("nvfp4", (".input_scale",), "nvfp4_w4a4", "auto", nv_bound)):
        broken = tmp_path / fmt
        shutil.copytree(bench.version_dir(out, 0, fmt), broken)
        assert bench.force_scales(broken, suffixes) > 0
        j = judge(probe, bench.score(broken, recipe, kv, probe), [], bound)
        assert j.verdict == ABOVE_BOUND, (fmt, j)


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory):
    """Versions 0 and 1 (one Adam step at lr 1e-3 apart) of the bench's plain policy, bf16."""
    bench = _bench()
    root = tmp_path_factory.mktemp("two_versions")
    return bench, root, bench.build_case(1, root, lr=1e-3, formats=["bf16"])


def test_serving_the_previous_version_is_told_apart_at_lr_1e_3(two_versions):
    from sampler_torch.engine import Engine

    bench, root, (_, p1) = two_versions
    bound = bound_for(load_bounds(), "bf16", "mixrl-engine", "cpu")
    verdicts = {}
    for served in (0, 1):
        engine = Engine(bench.version_dir(root, served, "bf16"), "bf16")
        q = flatten(engine.score(p1.prompts, p1.continuations))
        q_prev = flatten(engine.score(p1.prompts, p1.previous.continuations))
        verdicts[served] = judge(p1, q, q_prev, bound)
    assert verdicts[0].verdict == OLDER, verdicts[0]
    assert verdicts[1].verdict == OK, verdicts[1]
    assert verdicts[1].separation > 3 * bound.noise  # decidable: bf16 at lr 1e-3


class _NoopReload:
    """An engine whose reload is acknowledged but not applied: the fault the weights check must
    catch (what a server that ignores an update would do)."""

    def __init__(self, engine):
        self.inner, self.version, self.reloads = engine, engine.version, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def load_weights(self, path, version):
        self.reloads += 1
        self.version = int(version)


def test_a_noop_reload_is_caught_within_one_version_then_revoked(two_versions, tmp_path):
    from test_service import FAST, TOKEN, make_service

    from sampler_torch.client import RolloutClient
    from sampler_torch.engine import Engine
    from sampler_torch.loop import LoopConfig, SamplerLoop

    bench, root, probes = two_versions
    svc = make_service()
    try:
        for p in probes:
            svc.publish_version(p.version, {"bf16": bench.version_dir(root, p.version, "bf16")},
                                probe=p)
            if p.version == 0:
                engine = _NoopReload(Engine(bench.version_dir(root, 0, "bf16"), "bf16"))
                client = RolloutClient(svc.address, TOKEN, group="g", backoff=FAST, capacity=1,
                                       max_retry_s=3.0, weight_formats=("bf16",))
                loop = SamplerLoop(client, engine, LoopConfig(weights_cache=str(tmp_path / "c")))
                client.register()
                loop.start_background()  # heartbeats and the weights watcher
                watcher = loop._threads[-1]
                deadline = time.monotonic() + 60
                while not loop.stats.probe_acks and time.monotonic() < deadline:
                    time.sleep(0.05)
                # version 0, as loaded at start, verifies
                assert loop.stats.probe_acks[0].verdict in (OK, UNDECIDED)
        watcher.join(60)
        assert not watcher.is_alive()  # revoked: the loop stopped
        acks = loop.stats.probe_acks
        assert acks[-1].action == pb.ProbeAck.REVOKED and "unchanged" in acks[-1].reason
        assert engine.reloads == 2  # the load of version 1 and the one reload it was asked for
        st = {s["name"]: s for s in svc.status()["samplers"]}
        (s,) = st.values()
        assert s["revoked"] and "unchanged" in s["revoked_reason"], s
        assert s["probe"]["verified_version"] == 0 and s["probe"]["verdict"] == "noop_reload"
        status = svc.status_pb()
        assert status.samplers[0].verified_version == 0
        assert status.samplers[0].probe_verdict == "noop_reload"
        client.close()
    finally:
        svc.stop(grace=0)


def _session(group="g"):
    from trainer_jax.service.sessions import Session

    return Session(id="s1", name="s1", group=group, recipe={"name": "nvfp4_w4a4"},
                   accelerator="cpu", capacity=1, weight_formats=("nvfp4",), peer="", last_seen=0.0)


def _report(probe: Probe, shift: float) -> pb.ProbeReport:
    return pb.ProbeReport(version=probe.version,
                          logprobs=[x - shift for x in flatten(probe.logprobs)])


def test_run_bounds_alarm_on_a_jump_over_the_groups_own_baseline_once():
    """A trained policy's mismatch is far above the table's tiny random policies: by default the
    alarm is relative to the group's first reports (service.probe.bounds: run), and it is raised
    once when a sampler goes above, not at every version; bounds: table judges the table as is."""
    from trainer_jax.config import ProbeConfig
    from trainer_jax.service.probes import ProbeBook

    table = {"nvfp4_w4a4/engine/cpu": Bound(kl=1e-4, max_abs=0.05, noise=0.01, measured_on="cpu")}
    book, s = ProbeBook(ProbeConfig(), bounds=table), _session()
    verdicts = []
    for v, shift in enumerate((0.3, 0.3, 0.3, 0.3, 2.0, 0.3, 2.0, 2.0, 2.0, 2.0, 0.3)):
        probe = Probe(v, 0, [[1]], [[2, 3]], [[-1.0, -2.0]])
        book.add(probe)
        action, _ = book.report(s, _report(probe, shift))
        assert action == pb.ProbeAck.OK
        verdicts.append(s.probe.verdict)
    # shift 0.3 is far above the table (KL 0.04 > 1e-4) but is this group's normal: no alarm;
    # a single jump (version 4) does not alarm, three in a row do (version 8), once
    assert verdicts == [OK, OK, OK, OK, ABOVE_BOUND, OK, *[ABOVE_BOUND] * 4, OK]
    assert len(book.alarms) == 1 and "version 8" in book.alarms[0], book.alarms
    assert s.probe.verified_version == 10  # the weights loaded every time: all verified
    strict, s2 = ProbeBook(ProbeConfig(bounds="table", alarm_after=1), bounds=table), _session()
    probe = Probe(0, 0, [[1]], [[2, 3]], [[-1.0, -2.0]])
    strict.add(probe)
    strict.report(s2, _report(probe, 0.3))
    assert s2.probe.verdict == ABOVE_BOUND
