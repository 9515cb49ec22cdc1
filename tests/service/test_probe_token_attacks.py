"""Attacks on the version probe, the trainer's probe records, the token file and the reward range
(issue 44, items 4-6): each one a sampler or a file could mount, each contained. Probe reports go
over real gRPC to a real service; files are real files, FIFOs and processes."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from fakes import fake_trajectory
from test_service import client, lease_all, make_service

from mixrl_wire import pb
from mixrl_wire.probe import ABOVE_BOUND, ERROR, OK, PROBE_FILE, Probe, flatten
from mixrl_wire.token_file import MAX_TOKEN_FILE_BYTES
from trainer_jax.config import ProbeConfig
from trainer_jax.service.auth import TokenError, read_token_file
from trainer_jax.service.probes import ProbeBook, record_path, write_record

LOGP = [[-0.5, -1.0, -2.0, -0.1], [-0.7, -0.2, -3.0, -1.5]]
PROBE = Probe(1, 0, [[1, 2], [7]], [[3, 4, 5, 6], [8, 9, 10, 11]], LOGP)
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def svc(published):
    s = make_service()
    s.publish_version(1, {"bf16": str(published[0]["bf16"])}, probe=PROBE)
    yield s
    s.stop(grace=0)


def _verdict(svc, logprobs, version: int = 1) -> pb.ProbeAck:
    c = client(svc, name=f"attacker-{time.monotonic_ns()}")
    ack = c.report_probe(pb.ProbeReport(version=version, logprobs=logprobs))
    st = [s for s in svc.status()["samplers"] if s["name"] == c.name][0]["probe"]
    if ack.verdict != OK:
        assert st["verified_version"] == -1 or ack.verdict == ABOVE_BOUND, st
    return ack


@pytest.mark.parametrize(("name", "logprobs", "expect"), [
    ("nan", [NAN] * 8, "not finite"),
    ("minus_inf", [-INF] + flatten(LOGP)[1:], "not finite"),
    ("one_short", flatten(LOGP)[:-1], "7 log-probabilities reported for 8"),
    ("one_extra", [*flatten(LOGP), -1.0], "9 log-probabilities reported for 8"),
    ("positive", [0.5] * 8, "<= 0"),
    ("empty", [], "0 log-probabilities reported for 8"),
])
def test_malformed_probe_reports_are_errors_and_verify_nothing(svc, name, logprobs, expect):
    ack = _verdict(svc, logprobs)
    assert ack.verdict == ERROR and expect in ack.reason, (name, ack)


def test_a_sampler_that_scores_nothing_is_above_the_bound_from_its_first_report(svc):
    """log q = 0 everywhere (or any constant): without a baseline ``bounds: run`` used to take
    anything; now a probe KL above MAX_RUN_KL (1 nat a token) is above the bound."""
    for constant in (0.0, -1e-3, -20.0):
        ack = _verdict(svc, [constant] * 8)
        assert ack.verdict == ABOVE_BOUND and ack.kl > 1.0, (constant, ack)
    honest = _verdict(svc, [x - 0.01 for x in flatten(LOGP)])  # a healthy recipe's small offset
    assert honest.verdict == OK and honest.kl < 1e-3


def test_reports_for_versions_without_a_probe_are_errors(svc):
    for version in (0, 2, 99, -1):
        ack = _verdict(svc, flatten(LOGP), version=version)
        assert ack.verdict == ERROR and "no probe kept" in ack.reason


def test_an_oversized_report_is_refused_before_it_is_judged(svc):
    c = client(svc, name="flood")
    with pytest.raises(Exception) as info:
        c.report_probe(pb.ProbeReport(version=1, logprobs=[-1.0] * 70_000))
    assert getattr(info.value, "code", None) in (grpc.StatusCode.INVALID_ARGUMENT,) or \
        "too large" in str(info.value)


def _export(root: Path, probe: Probe) -> Path:
    d = root / "weights" / f"v{probe.version:08d}" / "bf16"
    d.mkdir(parents=True)
    (d / PROBE_FILE).write_text(json.dumps(probe.public().to_json()))
    return d


def test_records_of_other_tokens_or_broken_records_are_not_used(tmp_path):
    """A record left from another run (same version, other tokens), a truncated one, or a
    published probe.json that carries forged log p: the book judges with none of them."""
    book = ProbeBook(ProbeConfig())
    d = _export(tmp_path, PROBE)
    other = Probe(1, 0, [[1, 2], [7]], [[3, 4, 5, 7], [8, 9, 10, 11]], LOGP)  # one token differs
    write_record(tmp_path / "probes", other)
    book.add_from_dir(1, d)
    assert 1 not in book.probes and "reports are not judged" in book.unjudged[1]
    record_path(tmp_path / "probes", 1).write_text('{"probe_format": 2, "version": 1, "seed"')
    book.add_from_dir(1, d)
    assert 1 not in book.probes
    # A forged probe.json with log p beside the run's true record: the record wins.
    forged = Probe(1, 0, PROBE.prompts, PROBE.continuations, [[-0.01] * 4, [-0.01] * 4])
    (d / PROBE_FILE).write_text(json.dumps(forged.to_json()))
    write_record(tmp_path / "probes", PROBE)
    book.add_from_dir(1, d)
    assert book.probes[1] == PROBE and 1 not in book.unjudged


@pytest.mark.timeout(120)
def test_a_token_file_swapped_for_a_fifo_while_read_never_hangs(tmp_path):
    """Between the stat and the open the path is renamed over by a FIFO and back, thousands of
    times: each read returns the token or one line naming the FIFO, never blocks."""
    path, fifo_tmp, file_tmp = tmp_path / "token", tmp_path / "f", tmp_path / "t"
    path.write_text("tok\n")
    stop = threading.Event()

    def swap():
        while not stop.is_set():
            os.mkfifo(fifo_tmp)
            os.replace(fifo_tmp, path)
            file_tmp.write_text("tok\n")
            os.replace(file_tmp, path)

    t = threading.Thread(target=swap, daemon=True)
    t.start()
    outcomes = {"token": 0, "fifo": 0}
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (sum(outcomes.values()) < 200 or not outcomes["token"]):
            try:
                token = read_token_file(path)
            except TokenError as e:
                assert "is a FIFO" in str(e) and "\n" not in str(e), e
                outcomes["fifo"] += 1
            else:
                assert token in ("tok", None)  # None: caught between the unlink and the rename
                outcomes["token"] += 1
    finally:
        stop.set()
        t.join(10)
    assert outcomes["token"] > 0 and sum(outcomes.values()) >= 200, outcomes


@pytest.mark.timeout(120)
def test_a_token_file_that_grows_while_read_is_read_with_a_bound(tmp_path):
    """``yes >> token``: whatever size the stat saw, at most 4097 bytes are read, then refused."""
    path = tmp_path / "token"
    path.write_text("tok\n")
    writer = subprocess.Popen(["sh", "-c", f"exec yes token >> '{path}'"])
    try:
        results = []
        deadline = time.monotonic() + 60
        while True:  # read at least once: on a loaded machine `yes` may outgrow the bound first
            try:
                results.append(len(read_token_file(path)))
            except TokenError as e:
                assert "bytes" in str(e) and str(MAX_TOKEN_FILE_BYTES) in str(e), e
                results.append(-1)
            if path.stat().st_size > 10 * MAX_TOKEN_FILE_BYTES or time.monotonic() > deadline:
                break
        with pytest.raises(TokenError, match="more than the 4096"):  # grown past the bound
            read_token_file(path)
        assert results and all(n <= MAX_TOKEN_FILE_BYTES for n in results)
    finally:
        writer.kill()
        writer.wait(10)


def test_a_reward_just_above_the_limit_in_float32_is_refused():
    """1e6 is exact in float32; the next float32 up (1000000.0625) is out of range, in the
    reward and in a part."""
    above = float(np.nextafter(np.float32(1e6), np.float32(np.inf)))
    assert above == 1000000.0625
    svc = make_service("tasks.count=100")
    try:
        _edge(svc, above)
    finally:
        svc.stop(grace=0)


def _edge(svc, above: float) -> None:
    c = client(svc, name="edge", capacity=8)
    trajs = [fake_trajectory(t, i, svc.vocab_size, np.random.default_rng(3))
             for t in lease_all(c, 4, tries=20) for i in t.sample_indices][:3]
    trajs[0].reward = above
    trajs[1].reward_parts.add(name="p", value=-above)
    trajs[2].reward = 1e6
    results = [c.submit(t) for t in trajs]
    assert [r.accepted for r in results] == [False, False, True]
    assert all("out_of_range" in r.reason for r in results[:2])
