"""The probe service's behaviour its cosmic-ray mutants showed untested (issue 46; docs/testing.md):
``bound_for``'s fallbacks, where ``add_from_dir`` looks for the trainer's records, and the alarm
line's streak count."""

from __future__ import annotations

import json

from mixrl_wire import pb
from mixrl_wire.probe import PROBE_FILE, Bound, PreviousProbe, Probe
from trainer_jax.config import ProbeConfig
from trainer_jax.service.probes import DEFAULT_BOUND, ProbeBook, bound_for, record_path, write_record
from trainer_jax.service.sessions import Session


def _bound(kl: float, on: str) -> Bound:
    return Bound(kl=kl, max_abs=1.0, noise=1e-3, measured_on=on)


BOUNDS = {"bf16/engine/h100": _bound(1.0, "h100"), "fp8/engine/h100": _bound(2.0, "h100"),
          "fp8/vllm/cpu": _bound(3.0, "cpu"), "nvfp4_w4a4/engine/h100": _bound(4.0, "h100"),
          "nvfp4_w4a4/vllm/cpu": _bound(5.0, "cpu")}


def test_bound_for_is_exact_then_same_recipe_and_backend_then_same_recipe_then_the_default():
    assert bound_for(BOUNDS, "fp8", "vllm", "cpu") is BOUNDS["fp8/vllm/cpu"]
    # another device: the same recipe and backend (mixrl-engine is "engine"), not another recipe's
    assert bound_for(BOUNDS, "fp8", "mixrl-engine", "a100") is BOUNDS["fp8/engine/h100"]
    assert bound_for(BOUNDS, "fp8", "engine", "a100") is BOUNDS["fp8/engine/h100"]
    assert bound_for(BOUNDS, "nvfp4_w4a4", "vllm", "h100") is BOUNDS["nvfp4_w4a4/vllm/cpu"]
    # another backend: the recipe's first bound (in key order)
    assert bound_for(BOUNDS, "fp8", "sglang", "h100") is BOUNDS["fp8/engine/h100"]
    assert bound_for(BOUNDS, "bf16", "sglang", "cpu") is BOUNDS["bf16/engine/h100"]
    # a recipe the table lacks: the default, never a neighbour's bound (names that sort after it)
    assert bound_for(BOUNDS, "int4", "engine", "h100") is DEFAULT_BOUND
    assert bound_for(BOUNDS, "int4", "sglang", "cpu") is DEFAULT_BOUND
    assert bound_for(BOUNDS, "a8", "engine", "h100") is DEFAULT_BOUND


def _probe(version: int) -> Probe:
    prev = PreviousProbe(version - 1, [[4, 4]], [[-1.0, -1.0]], [[-2.0, -2.0]])
    return Probe(version, 0, [[1]], [[2, 3]], [[-1.0, -2.0]], prev)


def test_the_trainers_records_are_looked_for_only_beside_the_versions_root(tmp_path):
    # An export at <run>/weights/v00000003/bf16 (and <run>/weights/v00000003): its record is
    # <run>/probes/v00000003.json, the one place named when it is missing.
    run = tmp_path / "run"
    for export in (run / "weights" / "v00000003" / "bf16", run / "weights" / "v00000003"):
        export.mkdir(parents=True, exist_ok=True)
        (export / PROBE_FILE).write_text(json.dumps(_probe(3).public().to_json()))
        book = ProbeBook(ProbeConfig(bounds="table"), bounds=BOUNDS)
        book.add_from_dir(3, export)
        assert 3 not in book.probes
        assert book.unjudged[3] == (f"the trainer's log p of version 3 is in none of "
                                    f"{record_path(run / 'probes', 3)}: reports are not judged")
    write_record(run / "probes", _probe(3))
    book = ProbeBook(ProbeConfig(bounds="table"), bounds=BOUNDS)
    book.add_from_dir(3, run / "weights" / "v00000003" / "bf16")
    assert book.probes[3] == _probe(3) and not book.unjudged


def _session() -> Session:
    return Session(id="s1", name="s1", group="g", recipe={"name": "nvfp4_w4a4"}, accelerator="cpu",
                   capacity=1, weight_formats=("nvfp4",), peer="", last_seen=0.0)


def test_the_alarm_line_counts_reports_in_a_row_only_past_the_first():
    above = {"nvfp4_w4a4/engine/cpu": Bound(kl=1e-4, max_abs=0.05, noise=0.01, measured_on="cpu")}
    for alarm_after, suffix in ((1, None), (2, " (2 reports in a row)"), (3, " (3 reports in a row)")):
        book, s = ProbeBook(ProbeConfig(bounds="table", alarm_after=alarm_after), bounds=above), _session()
        for v in range(1, alarm_after + 1):
            book.add(_probe(v))
            book.report(s, pb.ProbeReport(version=v, logprobs=[-3.0, -4.0], previous_logprobs=[-2.0, -2.0]))
        (line,) = book.alarms
        assert line.startswith("probe alarm: sampler s1 (group g, recipe nvfp4_w4a4, cpu) on version "
                               f"{alarm_after}: "), line
        assert "in a row" not in line if suffix is None else line.endswith(suffix), line
