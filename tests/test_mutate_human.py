"""``scripts/mutate_human.py``'s generator (issue 46 item 3): each operator on a small source gives
the expected mutants and nothing else, no mutant lands inside an annotation, every mutant
compiles and changes exactly its segment, and the session's report counts what it should."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import mutate_human  # noqa: E402

SOURCE = '''from __future__ import annotations


def f(xs: list[int], limit: int = 3) -> dict[str, int]:
    if not xs:
        raise ValueError("empty")
    if limit < 0:
        return {}
    total = 0
    for x in xs[1:limit]:
        total += x * 2
    order = sorted(xs, key=lambda x: -x)
    worst = sorted(xs, reverse=True)
    best = max(xs, key=abs)
    return dict(total=total + limit, first=order[0], size=len(worst), best=best)
'''


def _by_op(source: str = SOURCE) -> dict[str, list[tuple[int, str, str]]]:
    out: dict[str, list[tuple[int, str, str]]] = {}
    for m in mutate_human.mutants(source, "f.py"):
        out.setdefault(m.operator, []).append((m.line, m.original, m.replacement))
    return out


def _lines(m: mutate_human.Mutant, source: str = SOURCE) -> tuple[str, str]:
    """The changed line, before and after."""
    after = m.apply(source)
    return source.splitlines()[m.line - 1].strip(), after.splitlines()[m.line - 1].strip()


def test_each_operator_gives_the_expected_mutants():
    ops = _by_op()
    assert set(ops) == set(mutate_human.OPERATORS)
    assert ops["boundary"] == [(7, "limit < 0", "(limit <= 0)")]
    assert ops["guard"] == [(5, "not xs", "False"), (7, "limit < 0", "False")]
    assert sorted(ops["drop_term"]) == sorted([
        (11, "total += x * 2", "pass"), (11, "x * 2", "(x)"), (11, "x * 2", "(2)"),
        (15, "total + limit", "(total)"), (15, "total + limit", "(limit)")])
    assert sorted(ops["sort_order"]) == sorted([
        (12, "sorted(xs, key=lambda x: -x)", "(sorted(xs, key=lambda x: -x, reverse=True))"),
        (12, "sorted(xs, key=lambda x: -x)", "(sorted(xs, key=lambda x: x))"),
        (13, "sorted(xs, reverse=True)", "(sorted(xs))"),
        (14, "max(xs, key=abs)", "(min(xs, key=abs))")])
    assert sorted(ops["slice_off_by_one"]) == sorted([
        (10, "1:limit", "1 + 1:limit"), (10, "1:limit", "1 - 1:limit"),
        (10, "1:limit", "1:limit + 1"), (10, "1:limit", "1:limit - 1")])
    # neighbouring keywords with different values, each pair once; flags and key functions never
    assert sorted(r for _, _, r in ops["swap_kwargs"]) == sorted([
        "(dict(total=order[0], first=total + limit, size=len(worst), best=best))",
        "(dict(total=total + limit, first=len(worst), size=order[0], best=best))",
        "(dict(total=total + limit, first=order[0], size=best, best=len(worst)))"])


def test_a_mutant_changes_its_segment_only_and_compiles():
    every = mutate_human.mutants(SOURCE, "f.py")
    assert len({m.key for m in every}) == len(every)
    for m in every:
        after = m.apply(SOURCE)
        ast.parse(after)
        changed = [i for i, (a, b) in enumerate(zip(SOURCE.splitlines(), after.splitlines(), strict=True))
                   if a != b]
        assert changed == [m.line - 1], m
    guard = next(m for m in every if m.operator == "guard" and m.line == 5)
    assert _lines(guard) == ("if not xs:", "if False:")
    aug = next(m for m in every if m.original.startswith("total +="))
    assert _lines(aug) == ("total += x * 2", "pass")


def test_no_mutant_inside_an_annotation():
    source = ("from __future__ import annotations\n\n\n"
              "def g(a: list[int] | None = None, *, k: dict[str, int] = {}) -> tuple[int, ...]:\n"
              "    b: list[int] = a[1:2]\n"
              "    return b\n")
    got = mutate_human.mutants(source, "g.py")
    assert {m.line for m in got} == {5} and all(m.operator == "slice_off_by_one" for m in got)
    assert len(got) == 4


def test_a_mutant_of_a_source_that_changed_is_refused():
    m = mutate_human.mutants(SOURCE, "f.py")[0]
    with pytest.raises(ValueError, match="the source changed under the mutant"):
        m.apply(SOURCE.replace("if not xs", "if not  xs"))


def test_the_report_counts_outcomes_and_judged_equivalents(tmp_path, monkeypatch):
    every = mutate_human.mutants(SOURCE, "f.py")[:4]
    done = {}
    for m, outcome in zip(every, ["killed", "survived", "timeout", "survived"], strict=True):
        before, after = _lines(m)
        done[m.key] = {"outcome": outcome, "file": m.file, "operator": m.operator, "line": m.line,
                       "original": m.original, "replacement": m.replacement, "code": before, "mutant": after}
    equivalent = done[every[3].key]
    listed = tmp_path / "eq.json"
    listed.write_text(json.dumps([{"file": "f.py", "code": equivalent["code"], "mutant": equivalent["mutant"],
                                   "why": "a test's reason"}]))
    monkeypatch.setattr(mutate_human.base, "EQUIVALENT", listed)
    state = {"meta": {"commit": "0" * 40, "seed": 1, "sample": 5}, "results": done,
             "chosen": [m.key for m in every] + ["pending-one"], "total": 30}
    out = mutate_human.write_report("m", state, tmp_path / "results")
    counts = [out[k] for k in ("killed", "survived", "timeout", "equivalent", "pending")]
    assert counts == [1, 1, 1, 1, 1]
    assert out["score"] == pytest.approx(2 / 3, abs=1e-3)  # killed + timeout of the three judged
    assert (out["sample_size"], out["mutants_total"]) == (5, 30)
    written = json.loads((tmp_path / "results" / "m.human.json").read_text())
    assert {s["equivalent"] for s in written["survivors"]} == {None, "a test's reason"}
    # after a change of the tests only the survivor not judged equivalent runs again
    assert mutate_human.rerun_after_test_change(done, mutate_human.base.load_equivalents()) == [every[1].key]


def test_a_stage_whose_tests_are_all_missing_is_refused(tmp_path):
    """A pytest given no path collects the whole suite (or nothing): a stage whose mapped test files
    are all absent from the commit must stop the run, not judge mutants by it. One present file is
    run alone, the missing ones named."""
    import mutate

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_here.py").write_text("def test_x():\n    pass\n")
    with pytest.raises(SystemExit, match="none of the tests tests/test_gone.py"):
        mutate.test_command(tmp_path, "sandbox", 30, tests=["tests/test_gone.py"])
    command = mutate.test_command(tmp_path, "sandbox", 30, quiet=True,
                                  tests=["tests/test_gone.py::test_a", "tests/test_here.py"])
    assert command.endswith("--timeout=30 tests/test_here.py"), command
