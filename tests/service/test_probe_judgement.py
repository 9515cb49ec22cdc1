"""The version probe's judgement (``mixrl_wire.probe.judge``) in its ``undecided`` region, and the
rollout service's actions (``ProbeBook.report``) across long sequences of reloads (issue 46),
each against a reference written here from the documented rules.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings

from mixrl_wire import pb
from mixrl_wire.probe import (
    ABOVE_BOUND,
    NOOP_RELOAD,
    OK,
    OLDER,
    UNDECIDED,
    Bound,
    PreviousProbe,
    Probe,
    judge,
)
from trainer_jax.config import ProbeConfig
from trainer_jax.service.probes import ProbeBook
from trainer_jax.service.sessions import Session

TABLE = {"nvfp4_w4a4/engine/cpu": Bound(kl=1e-4, max_abs=0.05, noise=0.01, measured_on="cpu")}


def _session() -> Session:
    return Session(id="s1", name="s1", group="g", recipe={"name": "nvfp4_w4a4"}, accelerator="cpu",
                   capacity=1, weight_formats=("nvfp4",), peer="", last_seen=0.0)


def _probe(version: int, old: list[float], now: list[float]) -> Probe:
    prev = PreviousProbe(version - 1, [[4] * len(old)], [list(old)], [list(now)])
    return Probe(version, 0, [[1]], [[2, 3]], [[-1.0, -2.0]], prev)


def test_a_noisy_sampler_is_undecided_not_older():
    """Issue 46: versions 0.01 apart (mean |Δ log p|) and a quantized sampler whose own noise is 0.1,
    a little nearer the previous version by chance. Its noise is the larger of the table's (1e-3)
    and its distance to the nearer version (0.1): 0.01 <= 3 x 0.1, undecided. With the report's
    own noise dropped from the margin it was judged ``older`` (and asked to reload, needlessly)."""
    old = [-3.0, -2.0, -2.5, -1.5]
    now = [x + 0.01 for x in old]
    probe = _probe(5, old, now)
    report = [x - 0.1 for x in old]  # 0.1 from old, 0.11 from now
    j = judge(probe, [-1.0, -2.0], report, Bound(kl=1.0, max_abs=1.0, noise=1e-3), margin=3.0)
    assert j.verdict == UNDECIDED, j
    assert "within 3 x the recipe's noise 1.00e-01" in j.reason
    # the same report against versions 1.0 apart: decidably the previous version
    far = _probe(5, old, [x + 1.0 for x in old])
    assert judge(far, [-1.0, -2.0], report, Bound(kl=1.0, max_abs=1.0, noise=1e-3)).verdict == OLDER


def _mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def reference_verdict(old: list[float], now: list[float], served: list[float], current_shift: float,
                      bound: Bound, margin: float) -> str:
    """The documented order: undecided when the versions differ by at most margin x the noise (the
    larger of the bound's and the report's distance to the nearer version), else older when nearer
    the previous; then above the bound; else ok."""
    separation = _mean_abs(old, now)
    d_old, d_now = _mean_abs(old, served), _mean_abs(now, served)
    verdict = OK
    if separation <= margin * max(bound.noise, min(d_old, d_now)):
        verdict = UNDECIDED
    elif d_old < d_now:
        return OLDER
    # the current probe's two tokens all shifted by current_shift: k3 = e^d - 1 - d, max |d|
    d = -current_shift
    if (math.exp(d) - 1 - d) > bound.kl or abs(d) > bound.max_abs:
        return ABOVE_BOUND
    return verdict


_lp = st.floats(-6.0, -2.0)  # log-probabilities stay <= 0 whatever is added below


@settings(max_examples=150, deadline=None)
@given(st.lists(_lp, min_size=1, max_size=6), st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.3, 1.0]),
       st.sampled_from(["old", "now"]), st.sampled_from([0.0, 0.005, 0.02, 0.1, 0.5]),
       st.sampled_from([0.0, 0.001, 0.3]), st.sampled_from([1.0, 3.0]))
@example([-3.0, -2.0, -2.5, -2.5], 0.01, "old", 0.1, 0.0, 3.0)
def test_judge_is_the_reference_around_the_undecided_region(old, sep, serves, noise, shift, margin):
    now = [x + sep * (1 if i % 2 else -1) for i, x in enumerate(old)]
    base = old if serves == "old" else now
    served = [x + noise * (1 if i % 3 else -1) for i, x in enumerate(base)]
    bound = Bound(kl=0.01, max_abs=0.2, noise=1e-3)
    probe = _probe(3, old, now)
    j = judge(probe, [-1.0 - shift, -2.0 - shift], served, bound, margin=margin)
    assert j.verdict == reference_verdict(old, now, served, shift, bound, margin)


# --- ProbeBook across sequences of reports: a reference state machine -------------------------

OLD, NOW = [-1.0, -1.0], [-2.0, -2.0]


def _report(kind: str, v: int) -> pb.ProbeReport:
    if kind == "noop":
        return pb.ProbeReport(version=v, weights_unchanged=True, weights_digest="ab" * 8)
    shift = 2.0 if kind == "above" else 0.0
    previous = OLD if kind == "older" else NOW
    return pb.ProbeReport(version=v, logprobs=[-1.0 - shift, -2.0 - shift], previous_logprobs=previous)


class ReferenceBook:
    """The actions the docs give (trainer_jax/service/probes.py): a no-op reload asks a reload up to
    max_reloads times, then revokes; older asks a reload up to max_reloads, else ok; a report that
    passes resets the count and verifies; above the bound (alarm_after 1, not enforced) verifies
    and keeps the count."""

    def __init__(self, max_reloads: int):
        self.max_reloads, self.asked, self.verified = max_reloads, 0, -1

    def report(self, kind: str, v: int) -> int:
        if kind in ("noop", "older"):
            if self.asked < self.max_reloads:
                self.asked += 1
                return pb.ProbeAck.RELOAD
            return pb.ProbeAck.REVOKED if kind == "noop" else pb.ProbeAck.OK
        self.verified = max(self.verified, v)
        if kind == "ok":
            self.asked = 0
        return pb.ProbeAck.OK


def test_no_op_reloads_spread_over_a_long_run_never_revoke_a_healthy_sampler():
    """Issue 46: one no-op reload per version, each fixed by the reload it asks for, over 20
    versions: never revoked. A counter never reset revoked it at the second."""
    book, s = ProbeBook(ProbeConfig(bounds="table", max_reloads=1), bounds=TABLE), _session()
    for v in range(1, 21):
        book.add(_probe(v, OLD, NOW))
        assert book.report(s, _report("noop", v))[0] == pb.ProbeAck.RELOAD, v
        action, why = book.report(s, _report("ok", v))
        assert action == pb.ProbeAck.OK and s.probe.verdict == OK, (v, why)
    assert s.probe.verified_version == 20
    # two no-op reloads in a row with max_reloads 1: the second revokes
    book.add(_probe(21, OLD, NOW))
    assert book.report(s, _report("noop", 21))[0] == pb.ProbeAck.RELOAD
    action, why = book.report(s, _report("noop", 21))
    assert action == pb.ProbeAck.REVOKED and "after 1 reload request(s)" in why
    assert s.probe.verdict == NOOP_RELOAD


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["noop", "older", "ok", "above"]), min_size=1, max_size=25),
       st.sampled_from([0, 1, 2]))
def test_probe_book_actions_are_the_reference_on_generated_sequences(kinds, max_reloads):
    cfg = ProbeConfig(bounds="table", max_reloads=max_reloads, alarm_after=1)
    book, s, ref = ProbeBook(cfg, bounds=TABLE), _session(), ReferenceBook(max_reloads)
    for i, kind in enumerate(kinds):
        v = i // 2 + 1  # two reports per version at times, as after a reload
        book.add(_probe(v, OLD, NOW))
        want = ref.report(kind, v)
        got, why = book.report(s, _report(kind, v))
        assert got == want, (i, kinds, why)
        assert s.probe.verified_version == ref.verified
        assert s.probe.verdict == {"noop": NOOP_RELOAD, "older": OLDER, "ok": OK, "above": ABOVE_BOUND}[kind]
        if got == pb.ProbeAck.REVOKED:
            break


def test_a_report_exactly_at_the_margin_is_undecided():
    """separation == margin x noise: within (``<=``)."""
    old = [-1.0, -1.0]
    now = [-1.5, -1.5]  # 0.5 apart, exactly 5 x the table's 0.1 (no own noise: it serves now exactly)
    j = judge(_probe(2, old, now), [-1.0, -2.0], now, Bound(kl=1.0, max_abs=1.0, noise=0.1), margin=5.0)
    assert j.verdict == UNDECIDED
    j = judge(_probe(2, old, now), [-1.0, -2.0], old, Bound(kl=1.0, max_abs=1.0, noise=0.1), margin=4.99)
    assert j.verdict == OLDER
    with pytest.raises(Exception, match="log-probabilities reported"):
        judge(_probe(2, old, now), [-1.0], now, Bound(kl=1.0, max_abs=1.0, noise=0.1))


def test_a_tie_between_the_versions_is_not_older_and_a_bound_exactly_met_is_not_above():
    """Served exactly midway between the two versions: not ``older`` (strictly nearer the previous
    is the rule). A probe whose max |Δ| or KL equals the bound is within it."""
    old, now, mid = [-3.0, -3.0], [-2.0, -2.0], [-2.5, -2.5]
    j = judge(_probe(2, old, now), [-1.0, -2.0], mid, Bound(kl=1.0, max_abs=1.0, noise=1e-3), margin=1.0)
    assert j.verdict == OK, j
    at = Bound(kl=1.0, max_abs=0.5, noise=1e-3)
    j = judge(_probe(2, old, now), [-1.5, -2.5], now, at)
    assert j.current.max_abs == 0.5 and j.verdict == OK, j
    kl = j.current.kl
    assert judge(_probe(2, old, now), [-1.5, -2.5], now, Bound(kl=kl, max_abs=1.0, noise=1e-3)).verdict == OK
    assert judge(_probe(2, old, now), [-1.5, -2.5], now,
                 Bound(kl=math.nextafter(kl, 0.0), max_abs=1.0, noise=1e-3)).verdict == ABOVE_BOUND
    assert judge(_probe(2, old, now), [-1.5, -2.5], now, Bound(kl=1.0, max_abs=0.4999, noise=1e-3)).verdict \
        == ABOVE_BOUND


def test_pruning_the_probe_records_keeps_the_newest(tmp_path):
    """The run keeps log p of the versions samplers may still load: pruning removes the oldest,
    never the newest (a sorted order flipped removed the newest: mutate_human, probes.py)."""
    from trainer_jax.service.probes import prune_records

    for v in (3, 10, 1, 7, 2):  # written out of order; names sort as the versions do
        (tmp_path / f"v{v:08d}.json").write_text("{}")
    (tmp_path / "notes.json").write_text("{}")  # not a record: left alone
    prune_records(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json", "v00000007.json", "v00000010.json"]
    prune_records(tmp_path, 0)  # 0: keep everything (nothing to prune by)
    assert len(list(tmp_path.iterdir())) == 3
    prune_records(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json", "v00000010.json"]


def test_bounds_run_alarms_at_alarm_factor_times_the_groups_median():
    """With ``bounds: run`` the bound is alarm_factor x the median of the group's recent KLs: a
    baseline near 0.01 alarms at 0.15 (> 10 x 0.01), not at 0.08. The median dropped from the
    product left a fixed bound no such jump reached (mutate_human, probes.py)."""
    book = ProbeBook(ProbeConfig(alarm_after=1, baseline_versions=3), bounds=TABLE)
    s = _session()

    def report(v: int, shift: float) -> str:
        book.add(_probe(v, OLD, NOW))
        lq = [-1.0 - shift, -2.0 - shift]
        book.report(s, pb.ProbeReport(version=v, logprobs=lq, previous_logprobs=NOW))
        return s.probe.verdict

    assert [report(v, 0.1414) for v in (1, 2, 3)] == [OK, OK, OK]  # KL 0.0098 each: the baseline
    assert report(4, 0.4) == OK  # KL 0.07 < 0.098
    assert report(5, 0.6) == ABOVE_BOUND  # KL 0.149 > 0.098


@pytest.mark.parametrize("data", [[1, 2], "probe", 3, None])
def test_a_probe_file_that_is_no_json_object_is_one_probe_error(data):
    from mixrl_wire.probe import ProbeError

    with pytest.raises(ProbeError, match="^probe.json: expected a JSON object$"):
        Probe.from_json(data, "probe.json")


def test_a_probe_whose_continuations_all_ended_at_once_is_judged_not_a_crash():
    """A probe whose every continuation is empty (each prompt's first sampled token ended it) is a
    valid file; its reports carry no log-probabilities. The service judges them (zero tokens, KL
    0, ``ok``) instead of dividing by the zero token count (a ZeroDivisionError is no
    ``ProbeError``: it escaped the report handler)."""
    from mixrl_wire.probe import Comparison, compare

    assert compare([], []) == Comparison(0.0, 0.0, 0.0, 0)
    empty = Probe.from_json({"probe_format": 2, "version": 4, "seed": 0, "prompts": [[1], [2]],
                             "continuations": [[], []], "logprobs": [[], []]})
    book, s = ProbeBook(ProbeConfig(bounds="table"), bounds=TABLE), _session()
    book.add(empty)
    action, why = book.report(s, pb.ProbeReport(version=4, logprobs=[]))
    assert action == pb.ProbeAck.OK and s.probe.verdict == OK and s.probe.kl == 0.0, why


def test_a_probe_without_the_trainers_log_p_is_refused_not_judged():
    """``judge`` needs the trainer's log p: a published probe (``public()``) or a record whose
    previous continuation lacks one version's log p is a ``ProbeError`` naming it, even when the
    report sends no previous log-probabilities (then nothing else would notice: it read ``ok``)."""
    from mixrl_wire.probe import ProbeError

    probe = _probe(3, OLD, NOW)
    bound = Bound(kl=1.0, max_abs=1.0, noise=1e-3)
    assert judge(probe, [-1.0, -2.0], [], bound).verdict == OK  # the full record judges
    with pytest.raises(ProbeError, match="the probe of version 3 holds no log p"):
        judge(probe.public(), [-1.0, -2.0], [], bound)
    half = Probe(3, 0, [[1]], [[2, 3]], [[-1.0, -2.0]], PreviousProbe(2, [[4, 4]], [OLD], None))
    with pytest.raises(ProbeError, match="holds no log p"):
        judge(half, [-1.0, -2.0], [], bound)
