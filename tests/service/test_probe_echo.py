"""The version probe cannot be echoed (issue 44, item 5): the published ``probe.json`` carries the
probe's tokens and not the trainer's log p, which stay in the run directory
(``<run>/probes/v00000000.json``); a ``ReportProbe`` sending back what ``probe.json`` holds is not
judged ``ok``, an honest sampler's report (the engine scoring the published tokens through
``sampler_torch.probe.build_report``) still is. ``mixrl-train serve``'s path
(``RolloutService.from_config`` + ``publish_version`` of a directory) judges with the run
directory's record, says so when there is none, and older probe files with log p inside still
load. Real publisher, real engine, real gRPC on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from test_service import BASE, TOKEN, client, make_service

from mixrl_wire import pb
from mixrl_wire.probe import ERROR, OK, PROBE_FILE, Probe, ProbeError, flatten, judge, read_probe
from trainer_jax.config import load_config
from trainer_jax.service import RolloutService
from trainer_jax.service.probes import DEFAULT_BOUND, read_record, record_path
from trainer_jax.service.server import weight_dirs

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_probe", REPO / "benchmarks/bench_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Versions 0 and 1 (one Adam step at lr 1e-3 apart) of a tiny policy published by the
    trainer's own ``Publisher`` with its ``Prober``, as a run does: ``<run>/weights``,
    ``<run>/probes``."""
    import numpy as np

    from convert.qwen3_config import Qwen3Config
    from trainer_jax.models import init_model
    from trainer_jax.probe import Prober
    from trainer_jax.publisher import Publisher, snapshot

    bench = _bench()
    root = tmp_path_factory.mktemp("probe_run")
    cfg = Qwen3Config(**bench.SHAPE)
    model = init_model(cfg, seed=0)
    rng = np.random.default_rng(0)
    prober = Prober([rng.integers(1, cfg.vocab_size, 12).tolist() for _ in range(4)], tokens=16, seed=0)
    state = {"model": model}
    publisher = Publisher(root / "weights", cfg.to_hf_dict(), lambda: ["bf16"], None, None,
                          lambda v, paths: None, engines=lambda: "mixrl",
                          prober=lambda v: prober(state["model"], v), probe_dir=root / "probes")
    try:
        publisher.publish_now(0, snapshot(model))
        ids = np.asarray(rng.integers(1, cfg.vocab_size, (4, 32)), np.int32)
        state["model"] = bench.adam_step(model, ids, 1e-3)
        publisher.publish_now(1, snapshot(state["model"]))
    finally:
        publisher.close()
    assert not publisher.errors, publisher.errors
    return root, dict(publisher.probes)


def _dir(root: Path, version: int) -> Path:
    return root / "weights" / f"v{version:08d}" / "bf16"


def _echo(directory: Path, version: int) -> pb.ProbeReport:
    """The echoing sampler: every number ``probe.json`` holds where log q belongs."""
    data = json.loads((directory / PROBE_FILE).read_text())
    prev = data.get("previous") or {}
    return pb.ProbeReport(version=version, logprobs=flatten(data.get("logprobs", [])),
                          previous_logprobs=flatten(prev.get("logprobs_now", [])))


def _honest(directory: Path, version: int) -> pb.ProbeReport:
    from sampler_torch.engine import Engine
    from sampler_torch.probe import build_report

    return build_report(Engine(directory, "bf16"), version, directory, before=None, files_changed=False)


def test_published_probe_has_no_log_p_and_the_run_keeps_them(run):
    root, probes = run
    for version in (0, 1):
        text = (_dir(root, version) / PROBE_FILE).read_text()
        assert "logprobs" not in text  # neither the version's nor the previous version's
        published = read_probe(_dir(root, version))
        assert published.logprobs is None and not published.has_logprobs
        assert published == probes[version].public()
        record = read_record(root / "probes", published)
        assert record == probes[version] and record.has_logprobs
        assert record_path(root / "probes", version).stat().st_size > 0
    assert read_probe(_dir(root, 1)).previous.continuations == probes[0].continuations
    assert sorted(p.name for p in (root / "probes").iterdir()) == ["v00000000.json", "v00000001.json"]
    with pytest.raises(ProbeError, match="holds no log p"):
        judge(read_probe(_dir(root, 0)), [], [], DEFAULT_BOUND)


def test_the_trainer_judges_honest_reports_ok_and_echoes_not(run):
    root, probes = run
    svc = make_service()
    try:
        for version in (0, 1):  # as the publish stage announces a version: its probe, with its log p
            svc.publish_version(version, {"bf16": str(_dir(root, version))}, probe=probes[version])
        honest, echo = client(svc, name="honest"), client(svc, name="echo")
        for version in (0, 1):
            ack = honest.report_probe(_honest(_dir(root, version), version))
            assert ack.action == pb.ProbeAck.OK and ack.verdict == OK, ack
            bad = echo.report_probe(_echo(_dir(root, version), version))
            assert bad.verdict == ERROR and "0 log-probabilities reported for 64" in bad.reason, bad
        st = {s["name"]: s["probe"] for s in svc.status()["samplers"]}
        assert st["honest"]["verified_version"] == 1 and st["echo"]["verified_version"] == -1
    finally:
        svc.stop(grace=0)


def _serve(run_dir: Path, weights_dir: Path) -> RolloutService:
    """What ``mixrl-train serve --weights-dir W run.dir=R`` builds (cli.serve_main)."""
    cfg = load_config(None, [*BASE, f"run.dir={run_dir}", f"service.weights_dir={weights_dir}"])
    svc = RolloutService.from_config(cfg, token=TOKEN).start()
    svc.publish_version(0, weight_dirs(cfg.service.weights_dir, cfg.service.weights_format))
    return svc


def test_serve_judges_with_the_run_directory_record_or_says_it_cannot(run, tmp_path):
    root, _ = run
    # Served from the run (run.dir names it; or found beside <run>/weights): judged.
    for run_dir in (root, tmp_path / "elsewhere"):
        svc = _serve(run_dir, root / "weights" / "v00000000")
        try:
            honest, echo = client(svc, name="honest"), client(svc, name="echo")
            assert honest.report_probe(_honest(_dir(root, 0), 0)).verdict == OK
            assert echo.report_probe(_echo(_dir(root, 0), 0)).verdict == ERROR
        finally:
            svc.stop(grace=0)
    # A copy of the version away from its run, run.dir elsewhere: no record, nothing judged.
    copy = tmp_path / "copied" / "v00000000"
    shutil.copytree(root / "weights" / "v00000000", copy)
    svc = _serve(tmp_path / "other-run", copy)
    try:
        ack = client(svc, name="honest").report_probe(_honest(copy / "bf16", 0))
        assert ack.verdict == ERROR and "reports are not judged" in ack.reason
        assert str(tmp_path / "other-run" / "probes" / "v00000000.json") in ack.reason
        assert svc.status()["samplers"][0]["probe"]["verified_version"] == -1
    finally:
        svc.stop(grace=0)


def test_older_probe_files_with_log_p_inside_still_load(run, tmp_path):
    root, probes = run
    legacy = tmp_path / "weights" / "v00000000"
    shutil.copytree(root / "weights" / "v00000000", legacy)
    (legacy / "bf16" / PROBE_FILE).write_text(json.dumps(probes[0].to_json() | {"probe_format": 1}))
    (legacy / "bf16" / "manifest.json").unlink()  # it hashed the new probe.json
    assert read_probe(legacy / "bf16") == probes[0]  # format 1, log p inside
    svc = _serve(tmp_path / "no-run", legacy)
    try:
        assert client(svc, name="h").report_probe(_honest(legacy / "bf16", 0)).verdict == OK
    finally:
        svc.stop(grace=0)
    broken = probes[0].to_json() | {"probe_format": 1}
    del broken["logprobs"]
    with pytest.raises(ProbeError, match="missing 'logprobs'"):
        Probe.from_json(broken)

