"""Mutants people would write (issue 46 item 3), beside cosmic-ray's operators (``scripts/mutate.py``).

cosmic-ray plants every operator swap it can (``+`` for ``*``, ``is`` for ``==`` ...): most are
bugs nobody writes, killed by any test that runs the line. The bugs that slip past review are
smaller and more plausible: a boundary moved by one, a term dropped, an order flipped, a check
removed, two keyword arguments swapped, a slice off by one. This module plants those, from the
AST, one at a time:

- ``boundary``: ``<`` <-> ``<=``, ``>`` <-> ``>=`` in a comparison;
- ``drop_term``: ``a + b`` -> ``a`` or ``b``, ``a - b`` / ``a * b`` / ``a / b`` -> ``a`` (and
  ``a * b`` -> ``b``), an augmented ``x += y`` / ``x -= y`` / ``x *= y`` removed (``pass``);
- ``sort_order``: ``reverse=True`` dropped from ``sorted`` / ``.sort``, or ``reverse=True``
  added where there is none; ``key=lambda x: -e`` -> ``key=lambda x: e``; ``max`` <-> ``min``
  where a ``key=`` names the order;
- ``guard``: an ``if ...: raise ...`` / ``if ...: return ...`` (no ``else``) never taken
  (its test becomes ``False``);
- ``swap_kwargs``: two neighbouring keyword arguments of a call exchange their values;
- ``slice_off_by_one``: each given bound of a slice ``+ 1`` and ``- 1``.

Nothing inside an annotation is mutated (never evaluated under ``from __future__ import
annotations``, which every core module has). A mutant is the original file with one node's
source segment replaced by the mutated node, unparsed, so the rest of the file (comments, line
numbers) is untouched.

Runs in the clone ``scripts/mutate.py`` prepares, with its baseline, timeout and ``MODULES``
test lists; resumable (``MUTATE_DIR/sessions/<module>.human.json``: results survive an
interrupted run; the same module sources, sample and seed continue it; when only the tests
changed, the survivors not judged equivalent run again); writes ``docs/mutation/<module>.human.json``.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import datetime
import json
import random
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import mutate as base

OPERATORS = ("boundary", "drop_term", "sort_order", "guard", "swap_kwargs", "slice_off_by_one")
_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}


@dataclasses.dataclass(frozen=True)
class Mutant:
    file: str
    operator: str
    line: int
    col: int
    end: tuple[int, int]     # (end line, end col) of the replaced segment
    replacement: str         # the segment's new source
    original: str            # the segment's old source

    @property
    def key(self) -> str:
        return f"{self.file}:{self.line}:{self.col}:{self.operator}:{self.replacement}"

    def apply(self, source: str) -> str:
        """``source`` with this mutant's segment replaced."""
        lines = source.splitlines(keepends=True)
        offsets = [0]
        for ln in lines:
            offsets.append(offsets[-1] + len(ln.encode()))
        raw = source.encode()
        lo = offsets[self.line - 1] + self.col
        hi = offsets[self.end[0] - 1] + self.end[1]
        if raw[lo:hi].decode() != self.original:
            raise ValueError(f"{self.file}:{self.line}: the source changed under the mutant")
        return (raw[:lo] + self.replacement.encode() + raw[hi:]).decode()


def _annotation_nodes(tree: ast.AST) -> set[int]:
    """ids of every node inside an annotation (skipped: never evaluated)."""
    return {id(n) for a in base.annotations(tree) for n in ast.walk(a)}


def _variants(node: ast.AST) -> Iterator[tuple[str, ast.AST | str]]:
    """(operator, replacement node or source) for each human-style mutant of ``node`` itself."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _FLIP:
                new = copy.deepcopy(node)
                new.ops[i] = _FLIP[type(op)]()
                yield "boundary", new
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
        yield "drop_term", node.left
        if isinstance(node.op, ast.Add | ast.Mult):
            yield "drop_term", node.right
    elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
        yield "drop_term", "pass"
    elif isinstance(node, ast.Call):
        yield from _call_variants(node)
    elif isinstance(node, ast.If) and not node.orelse and len(node.body) == 1 \
            and isinstance(node.body[0], ast.Raise | ast.Return):
        yield "guard", "__test__"  # the test becomes False (see _segment)
    elif isinstance(node, ast.Slice):
        for part in ("lower", "upper"):
            bound = getattr(node, part)
            if bound is None:
                continue
            for op in (ast.Add(), ast.Sub()):
                new = copy.deepcopy(node)
                setattr(new, part, ast.BinOp(copy.deepcopy(bound), op, ast.Constant(1)))
                yield "slice_off_by_one", new


def _call_variants(node: ast.Call) -> Iterator[tuple[str, ast.AST]]:
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    kws = {k.arg: k for k in node.keywords if k.arg}
    if name in ("sorted", "sort"):
        new = copy.deepcopy(node)
        rev = kws.get("reverse")
        if rev is None:
            new.keywords.append(ast.keyword("reverse", ast.Constant(True)))
            yield "sort_order", new
        elif isinstance(rev.value, ast.Constant) and rev.value.value is True:
            new.keywords = [k for k in new.keywords if k.arg != "reverse"]
            yield "sort_order", new
    key = kws.get("key")
    if name in ("sorted", "sort", "max", "min") and key is not None and isinstance(key.value, ast.Lambda) \
            and isinstance(key.value.body, ast.UnaryOp) and isinstance(key.value.body.op, ast.USub):
        new = copy.deepcopy(node)
        k = next(k for k in new.keywords if k.arg == "key")
        k.value.body = k.value.body.operand
        yield "sort_order", new
    if isinstance(func, ast.Name) and name in ("max", "min") and key is not None:
        new = copy.deepcopy(node)
        new.func.id = "min" if name == "max" else "max"
        yield "sort_order", new
    # values a person could put in either place (not a flag or a key function: swapping those
    # is a TypeError at the first call, nobody's bug)
    named = [k for k in node.keywords if k.arg and not isinstance(k.value, ast.Lambda) and not _flag(k.value)]
    for a, b in zip(named, named[1:], strict=False):
        if ast.dump(a.value) != ast.dump(b.value):
            new = copy.deepcopy(node)
            ka = next(k for k in new.keywords if k.arg == a.arg)
            kb = next(k for k in new.keywords if k.arg == b.arg)
            ka.value, kb.value = kb.value, ka.value
            yield "swap_kwargs", new


def _flag(value: ast.AST) -> bool:
    return isinstance(value, ast.Constant) and any(value.value is c for c in (True, False, None))


def mutants(source: str, file: str) -> list[Mutant]:
    """Every human-style mutant of ``source`` (``file`` names it), in source order."""
    tree = ast.parse(source)
    skip = _annotation_nodes(tree)

    def segment(node: ast.AST) -> str:
        return ast.get_source_segment(source, node) or ""

    out: list[Mutant] = []
    for node in ast.walk(tree):
        if id(node) in skip or not hasattr(node, "lineno"):
            continue
        for op, new in _variants(node):
            target = node
            if new == "__test__":  # the guard: only its test is replaced
                target, text = node.test, "False"
            elif isinstance(new, str):
                text = new
            else:
                text = ast.unparse(new)
                if isinstance(node, ast.Slice):
                    text = text.strip("()")
                elif not isinstance(node, ast.stmt):
                    text = f"({text})"
            original = segment(target)
            if not original or text == original:
                continue
            # ast's columns are utf-8 byte offsets, what Mutant.apply counts in
            m = Mutant(file, op, target.lineno, target.col_offset,
                       (target.end_lineno, target.end_col_offset), text, original)
            try:  # a replacement inside an f-string may clash with its quotes: not a mutant
                ast.parse(m.apply(source))
            except (SyntaxError, ValueError):
                continue
            out.append(m)
    return sorted(out, key=lambda m: (m.line, m.col, m.operator, m.replacement))


def module_mutants(clone: Path, paths: list[str]) -> list[Mutant]:
    files = []
    for p in paths:
        full = clone / p
        files += sorted(full.rglob("*.py")) if full.is_dir() else [full]
    out = []
    for f in files:
        rel = str(f.relative_to(clone))
        out += mutants(f.read_text(), rel)
    return out


def _save(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def run_module(name: str, *, workdir: Path, results: Path, sample: int | None, seed: int,
               timeout: float | None) -> dict:
    """Plant the module's human-style mutants one at a time in the clone and run its mapped
    tests; resume a session of the same sources, sample and seed."""
    clone = workdir / "clone"
    commit = base.prepare_clone(clone)
    paths, tests = base.MODULES[name]
    base.check_imports(clone, paths)
    # Two stages: the first mapped file alone (the module's own reference tests, seconds), then,
    # only if that passes, every mapped file. A failure in either is a kill; only a mutant that
    # passes both survives, so the score is the full list's, at a fraction of the time on a
    # loaded machine (a fresh interpreter importing torch or JAX costs most of a run). Each
    # stage's baseline (unmutated, must pass; x 3 + 15 s is its timeout) runs before its first use.
    stages = [tests[:1], tests] if len(tests) > 1 else [tests]
    limits: dict[int, float] = {}

    def stage_command(i: int) -> tuple[str, float]:
        if i not in limits:
            took = base.baseline_command(clone, base.test_command(clone, name, timeout or 3600, quiet=True,
                                                                  tests=stages[i]))
            limits[i] = timeout or max(30.0, 3 * took + 15)
            print(f"mutate {name} (human): stage {i + 1} baseline {took:.1f} s, timeout {limits[i]:.0f} s",
                  flush=True)
        return base.test_command(clone, name, limits[i], quiet=True, tests=stages[i]), limits[i]

    every = module_mutants(clone, paths)
    chosen = sorted(random.Random(seed).sample(range(len(every)), sample)) if sample and sample < len(every) \
        else list(range(len(every)))
    meta = {"commit": commit, "sample": sample, "seed": seed, "paths": paths,
            "sources": base.tree_ids(clone, paths), "tests": base.tree_ids(clone, tests)}
    session = workdir / "sessions" / f"{name}.human.json"
    session.parent.mkdir(parents=True, exist_ok=True)
    state = json.loads(session.read_text()) if session.exists() else {}
    old = state.get("meta", {})
    if all(old.get(k) == meta[k] for k in ("sample", "seed", "paths", "sources")):
        done = state.get("results", {})
        if old.get("tests") != meta["tests"]:
            again = rerun_after_test_change(done, base.load_equivalents())
            for k in again:
                del done[k]
            print(f"mutate {name} (human): the tests changed: {len(again)} survivors run again "
                  "(not those judged equivalent)")
    else:
        done = {}
    print(f"mutate {name} (human): commit {commit[:10]}, {len(chosen)} of {len(every)} mutants", flush=True)
    for i in chosen:
        m = every[i]
        if m.key in done:
            continue
        path = clone / m.file
        original = path.read_text()
        mutated = m.apply(original)
        t0 = time.monotonic()
        try:
            outcome = "survived"
            for k in range(len(stages)):
                path.write_text(original)
                stage, limit = stage_command(k)  # its baseline, on the unmutated file, the first time
                path.write_text(mutated)
                proc = subprocess.run(["nice", "-n", "19", *shlex.split(stage)], cwd=clone,
                                      env=base.test_env(clone), capture_output=True, text=True, timeout=limit)
                if proc.returncode != 0:
                    outcome = "killed"
                    break
        except subprocess.TimeoutExpired:
            outcome = "timeout"
        finally:
            path.write_text(original)
        done[m.key] = {"outcome": outcome, "s": round(time.monotonic() - t0, 1),
                       **{k: v for k, v in dataclasses.asdict(m).items() if k != "end"},
                       # the whole line before and after, as scripts/mutate_equivalent.json lists them
                       "code": original.splitlines()[m.line - 1].strip(),
                       "mutant": mutated.splitlines()[m.line - 1].strip()}
        print(f"  {outcome:8s} {m.file}:{m.line} {m.operator}: {m.original[:60]!r} -> {m.replacement[:60]!r}",
              flush=True)
        _save(session, {**state_of(meta, chosen, every), "results": done})
    state = {**state_of(meta, chosen, every), "results": done}
    _save(session, state)
    return write_report(name, state, results, stage_timeouts_s=[round(v) for v in limits.values()])


def rerun_after_test_change(done: dict, known: dict) -> list[str]:
    """The keys of the survivors in ``done`` to run again now that the tests changed: all but
    those ``known`` (``scripts/mutate_equivalent.json``) judges equivalent, which no test can kill
    (each costs a full run of every mapped file)."""
    return [k for k, r in done.items() if r["outcome"] == "survived"
            and not base.judged(known, r["file"], r["code"], r["mutant"], r["line"])]


def state_of(meta: dict, chosen: list[int], every: list[Mutant]) -> dict:
    return {"meta": meta, "chosen": [every[i].key for i in chosen], "total": len(every)}


def report_session(name: str, workdir: Path, results: Path) -> dict | None:
    """Write the report of an existing session again (after editing the equivalents)."""
    session = workdir / "sessions" / f"{name}.human.json"
    return write_report(name, json.loads(session.read_text()), results) if session.exists() else None


def write_report(name: str, state: dict, results: Path, **extra) -> dict:
    meta, done, chosen, total = state["meta"], state["results"], state["chosen"], state["total"]
    known = base.load_equivalents()
    counts = {"killed": 0, "survived": 0, "equivalent": 0, "timeout": 0, "pending": 0}
    survivors = []
    for key in chosen:
        r = done.get(key)
        if r is None:
            counts["pending"] += 1
        elif r["outcome"] == "survived":
            why = base.judged(known, r["file"], r["code"], r["mutant"], r["line"])
            counts["equivalent" if why else "survived"] += 1
            survivors.append({"file": r["file"], "operator": r["operator"], "line": r["line"],
                              "code": r["code"], "mutant": r["mutant"], "equivalent": why})
        else:
            counts[r["outcome"]] += 1
    run = counts["killed"] + counts["survived"] + counts["timeout"]
    out = {"module": name, "operators": "human", **meta,
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "mutants_total": total, "sample_size": len(chosen), **counts,
           "score": round((counts["killed"] + counts["timeout"]) / run, 3) if run else None,
           "survivors": sorted(survivors, key=lambda s: (s["file"], s["line"])), **extra}
    results.mkdir(parents=True, exist_ok=True)
    dest = results / f"{name}.human.json"
    tmp = dest.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(dest)
    print(f"mutate {name} (human): {counts['killed']} killed, {counts['timeout']} timeout, "
          f"{counts['survived']} survived, {counts['equivalent']} equivalent, {counts['pending']} pending "
          f"of {len(chosen)} (of {total}); -> {dest}")
    return out
