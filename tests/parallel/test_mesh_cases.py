"""Every module in ``cases/`` in one process of its own with 8 fake CPU devices.

XLA fixes the device count when JAX starts, and this process's JAX has one device (the rest of the
suite must not be slowed or changed by eight), so the case modules run as one
``python -m pytest cases/`` with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``, once for
the file (``outcomes``: a process per module paid JAX's and pytest's start, ~4 s of CPU, eight
times). Each module's test here reports its own cases from that run's JUnit report, with the
inner pytest's report of a failure as the assertion message. ``case_context.py`` runs in a second
process with XLA's current CPU fusion emitters (``NEW_EMITTERS``).
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from cpu_jax import cpu_jax_env

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
CASES = sorted(p.name for p in (HERE / "cases").glob("case_*.py"))


# The suite compiles with XLA's older CPU fusion emitters (tests/conftest.py: a fifth less CPU). Its
# context-parallel step then moves off its single-device reference by 1.1e-4, over the case's 1e-5
# (summation order inside the fusions, not the sharding): those cases compile with today's emitters.
NEW_EMITTERS = ("case_context.py",)
_EMITTERS = "--xla_cpu_use_fusion_emitters"

Outcomes = dict[str, list[tuple[str, str | None]]]


def _run_cases(tmp_path_factory, markers: str, cases: list[str], *,
               new_emitters: bool) -> tuple[Outcomes, str]:
    """``({module: [(test, failure text or None)]}, the run's output tail)`` of one inner run of
    ``cases``' tests selected by ``markers`` (a ``-m`` expression)."""
    report = tmp_path_factory.mktemp("mesh-cases") / "junit.xml"
    # TF_CPP_MIN_LOG_LEVEL=2 (cpu_jax_env): the partitioner's performance notes ("involuntary full
    # rematerialization") are noise here. PYTEST_ADDOPTS is the outer run's (a --junitxml there
    # would be overwritten by this run's).
    env = {k: v for k, v in cpu_jax_env(8).items() if k != "PYTEST_ADDOPTS"}
    if new_emitters:  # said outright: the inner run's tests/conftest.py adds only flags not set
        env["XLA_FLAGS"] = " ".join([*(f for f in env["XLA_FLAGS"].split() if f.split("=")[0] != _EMITTERS),
                                     f"{_EMITTERS}=true"])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
         "-m", markers, *(str(HERE / "cases" / case) for case in cases)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    tail = f"{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"
    found: Outcomes = {}
    if report.is_file():
        for case in ET.parse(report).iter("testcase"):
            module = case.get("classname", "").split(".")[-1] + ".py"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            failure = None if bad is None else (bad.text or bad.get("message", "failed"))
            found.setdefault(module, []).append((case.get("name", "?"), failure))
    return found, tail


def _run_all(tmp_path_factory, markers: str) -> tuple[Outcomes, str]:
    """Every case module's tests selected by ``markers``: two inner runs, by emitters."""
    found, tails = {}, []
    for new_emitters in (False, True):
        cases = [c for c in CASES if (c in NEW_EMITTERS) == new_emitters]
        got, tail = _run_cases(tmp_path_factory, markers, cases, new_emitters=new_emitters)
        found.update(got)
        tails.append(tail)
    return found, "\n".join(tails)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> tuple[Outcomes, str]:
    """The default run's cases: every case test not marked ``slow``."""
    return _run_all(tmp_path_factory, "not slow")


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", CASES)
def test_mesh_case(case: str, outcomes) -> None:
    found, tail = outcomes
    assert found.get(case), f"{case}: no test ran (the inner run's output):\n{tail}"
    failed = [f"{name}:\n{text[-6000:]}" for name, text in found[case] if text is not None]
    assert not failed, f"{case} failed:\n" + "\n".join(failed)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_mesh_cases_marked_slow(tmp_path_factory) -> None:
    """The parametrizations the default run leaves to ``make test-slow`` (each case module says why
    its ``slow`` ones repeat what another mesh or form already checks)."""
    found, tail = _run_all(tmp_path_factory, "slow")
    assert sum(len(v) for v in found.values()) >= 3, f"the slow mesh cases did not run:\n{tail}"
    failed = [f"{m}::{name}:\n{text[-6000:]}" for m, cases in found.items() for name, text in cases
              if text is not None]
    assert not failed, "\n".join(failed)
