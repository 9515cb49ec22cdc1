"""The checked-kernel registry: merge rules, atomic writes, lookup keys, and what ``auto`` picks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainer_jax.kernels import checked
from trainer_jax.kernels.checked import Where

H200 = Where("gpu", "NVIDIA H200", "0.10")
V = {"jax": "0.10.2", "jaxlib": "0.10.2", "torch": "2.13.0"}


def _entry(kernel, where=H200, passed=True, err=1e-3, versions=V, **extra):
    return checked.make_entry(kernel, where, passed=passed, max_err=err, tolerance=2e-2,
                              versions=versions, **extra)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    path = tmp_path / "checked.json"
    monkeypatch.setenv(checked.ENV, str(path))
    return path


def test_entry_holds_what_was_verified():
    e = _entry("attention:pallas_gpu", shape="8 x 4096")
    assert {k: e[k] for k in ("kernel", "platform", "device_kind", "jax_minor", "jax", "jaxlib", "torch",
                              "result", "max_err", "tolerance", "tiny", "shape")} == {
        "kernel": "attention:pallas_gpu", "platform": "gpu", "device_kind": "NVIDIA H200",
        "jax_minor": "0.10", **V, "result": "pass", "max_err": 1e-3, "tolerance": 2e-2, "tiny": False,
        "shape": "8 x 4096"}
    assert e["date"].endswith("Z") and len(e["date"]) == 20
    assert checked.jax_minor("0.10.2") == "0.10" and checked.jax_minor("0.7.0.dev1") == "0.7"


def test_merge_keeps_one_entry_per_key_and_a_fail_beats_a_pass(registry):
    checked.record([_entry("attention:pallas_gpu"), _entry("linear_logsumexp:pallas")])
    checked.record([_entry("attention:pallas_gpu", where=Where("gpu", "NVIDIA H100", "0.10"))])
    assert len(checked.load()) == 3  # another device kind is another key
    checked.record([_entry("attention:pallas_gpu", passed=False, err=0.4)])
    assert len(checked.load()) == 3
    assert checked.lookup("attention:pallas_gpu", H200)["result"] == "fail"
    # A pass from the same release does not clear the fail; one from a newer release does.
    checked.record([_entry("attention:pallas_gpu")])
    assert checked.lookup("attention:pallas_gpu", H200)["result"] == "fail"
    checked.record([_entry("attention:pallas_gpu", versions={**V, "jax": "0.10.3"})])
    e = checked.lookup("attention:pallas_gpu", H200)
    assert e["result"] == "pass" and e["jax"] == "0.10.3"
    # A newer pass replaces an older pass (its figures are the current ones).
    checked.record([_entry("linear_logsumexp:pallas", err=5e-3)])
    assert checked.lookup("linear_logsumexp:pallas", H200)["max_err"] == 5e-3
    keys = [checked.entry_key(e) for e in json.loads(registry.read_text())["entries"]]
    assert keys == sorted(keys)


# The writer: checked.py loaded by path (its package would import JAX, seconds of start-up).
_WRITER = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("checked", sys.argv[1])
checked = sys.modules["checked"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(checked)
entry = json.loads(sys.argv[3])
for i in range(300):
    checked.write([{**entry, "max_err": float(i)}] * (1 + i % 50), sys.argv[2])
"""


def test_write_is_atomic(registry):
    """A reader racing a writer (another process) only ever sees a whole file."""
    entry = _entry("attention:pallas_gpu")
    checked.write([entry], registry)
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, checked.__file__, str(registry),
                               json.dumps(entry)])
    reads = 0
    while writer.poll() is None or reads == 0:
        assert json.loads(registry.read_text())["entries"]  # never empty, never half-written
        reads += 1
    assert writer.wait() == 0 and reads > 1
    assert len(json.loads(registry.read_text())["entries"]) == 50  # the last write, whole
    assert not [p for p in os.listdir(registry.parent) if p.endswith(".tmp")]  # no temp left behind


def test_lookup_is_by_platform_device_kind_and_jax_minor(registry):
    checked.record([_entry("attention:pallas_gpu")])
    assert checked.verdict("attention:pallas_gpu", H200)[0]
    assert checked.verdict("attention:pallas_gpu", Where("gpu", "NVIDIA H200", "0.10"))[0]
    for other in (Where("tpu", "NVIDIA H200", "0.10"), Where("gpu", "NVIDIA H100", "0.10"),
                  Where("gpu", "NVIDIA H200", "0.11")):
        ok, why = checked.verdict("attention:pallas_gpu", other)
        assert not ok and why == f"pallas_gpu not checked on {other.describe()}"
    assert not checked.verdict("attention:cudnn", H200)[0]


def test_auto_picks_a_fused_kernel_only_where_it_passed(registry):
    from trainer_jax.kernels.linear_logsumexp.names import resolve_impl
    from trainer_jax.models.attention import default_impl

    assert checked.choose("linear_logsumexp", H200) == (
        "xla", "auto: pallas not checked on NVIDIA H200 with jax 0.10")
    assert checked.choose("attention", H200) == (
        "blocked", "auto: cudnn not checked on NVIDIA H200 with jax 0.10; "
                   "pallas_gpu not checked on NVIDIA H200 with jax 0.10")
    checked.record([_entry("linear_logsumexp:pallas"), _entry("attention:pallas_gpu", fwd_bwd_s=0.02),
                    _entry("attention:cudnn", passed=False, err=None, error="NotImplementedError: x")])
    name, why = checked.choose("linear_logsumexp", H200)
    assert name == "pallas" and why.startswith("auto: pallas checked on NVIDIA H200 with jax 0.10 ")
    assert why.endswith("max err 0.001 <= 0.02")
    assert checked.choose("attention", H200)[0] == "pallas_gpu"
    # Both attention kernels passed: the one measured faster wins.
    checked.record([_entry("attention:cudnn", versions={**V, "jax": "0.10.3"}, fwd_bwd_s=0.01)])
    assert checked.choose("attention", H200)[0] == "cudnn"
    assert default_impl(4096, where=H200) == "cudnn"
    # The CPU has no fused candidate, whatever the registry holds; this process is on the CPU.
    checked.record([_entry("linear_logsumexp:pallas", where=checked.here("cpu"))])
    assert resolve_impl("auto") == "xla" and default_impl(64) == "blocked"
    assert checked.choose("attention", checked.here("cpu")) == (
        "blocked", "auto: no fused attention kernel is a candidate on cpu")


def test_reasons_name_fails_and_toy_shape_runs(registry):
    checked.record([_entry("linear_logsumexp:pallas", passed=False, err=0.31),
                    _entry("attention:pallas_gpu", tiny=True),
                    _entry("attention:cudnn", passed=False, err=None,
                           error="NotImplementedError: head dim 100")])
    assert checked.choose("linear_logsumexp", H200) == (
        "xla", "auto: pallas failed its check on NVIDIA H200 with jax 0.10 (max err 0.31 > 0.02)")
    assert checked.choose("attention", H200) == (
        "blocked", "auto: cudnn failed its check on NVIDIA H200 with jax 0.10 (NotImplementedError: "
                   "head dim 100); pallas_gpu checked only at toy shapes (--tiny) on NVIDIA H200 with "
                   "jax 0.10")
    assert checked.describe_choice("attention", "auto", H200).startswith("attention: blocked (auto: cudnn ")
    # Correct but measured slower than the XLA path it would replace: not picked either.
    checked.record([_entry("linear_logsumexp:pallas", versions={**V, "jax": "0.10.3"}, fwd_bwd_s=0.03,
                           fallback_s=0.02)])
    assert checked.choose("linear_logsumexp", H200) == (
        "xla", "auto: pallas passed on NVIDIA H200 with jax 0.10 but was slower than the XLA path "
               "(30 ms vs 20 ms forward+backward)")
    assert checked.describe_choice("linear_logsumexp", "pallas", H200) == (
        "loss kernel: pallas (set by objective.impl)")


def test_the_shipped_registry_reads():
    """The package's own file (written by the device check on real hardware) parses."""
    entries = checked.load(checked.REGISTRY)
    assert all(e["result"] in ("pass", "fail") and e["tolerance"] > 0 for e in entries)


def test_a_damaged_registry_checks_nothing_instead_of_failing_start_up(registry):
    """A half-edited or corrupt file, or an entry without its figures, leaves auto on the XLA
    paths with a warning, never a traceback at start-up."""
    registry.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        assert checked.choose("linear_logsumexp", H200)[0] == "xla"
    registry.write_text(json.dumps({"entries": [
        {**_entry("linear_logsumexp:pallas"), "max_err": None},
        {"kernel": "attention:cudnn", "platform": None}]}))
    name, why = checked.choose("linear_logsumexp", H200)
    assert name == "xla" and "without its error figures" in why
    assert checked.choose("attention", H200)[0] == "blocked"
