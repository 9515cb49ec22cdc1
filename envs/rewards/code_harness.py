"""The ``code`` reward's harness: the row's asserts become values read out of the solution in the
jail and compared here, outside it, with expected values that never enter the jail.

Why not run the asserts after the solution, as before: then the verdict is the exit status of a
process the solution controls (``os._exit(0)``, ``sys.exit(0)``, an ``atexit`` or excepthook that
exits 0 all "passed"), and so is every comparison made in it (an object whose ``__eq__`` is always
true, a patched ``builtins`` or ``unittest``). Whatever runs in the solution's interpreter can be
subverted by it, so nothing there decides anything:

- ``parse_tests`` (``envs.rewards.code_tests``) splits each test with ``ast`` into the expression
  to evaluate (``add(2, 3)``) and a check kept on this side (``== 5``, ``ast.literal_eval``): only
  the expressions and the tests' imports go into the jail. A test whose expression would compare
  inside the jail (``or``, a nested comparison, ``== True`` around one, a conditional, ``all`` /
  ``any`` / ``bool`` / ``math.isclose`` over the reply's values) is an ``unsupported_test`` reward
  error (``envs.rewards.errors.RewardError``: scored 0 and counted), never a pass;
- in the jail, ``EVALUATOR`` imports the solution as a module, evaluates each expression and writes
  one line per expression, ``<nonce>{"i": n, "v": <value>}``, with the value encoded as plain data
  (None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset, exact types only; numpy
  scalars as their ``item()``): an always-equal object, an object with its own ``__bool__`` or an
  ``int`` subclass cannot be encoded, is reported ``{"i": n, "np": type}``, and the reward is a
  ``non_plain_value`` error;
- here, ``grade_output`` decodes each line strictly into fresh built-in values and runs the check;
  truth checks (``assert f(x)``, ``assert not f(x)``, ``is True``) pass only a plain ``True`` /
  ``False`` returned by a call of the reply's own code.

The recommended row form needs no parsing of comparisons at all: a list of
``{"call": "add(2, 3)", "expect": 5}`` (``expect`` is JSON: a tuple result equals a list;
``abs_tol`` / ``rel_tol`` for floats), beside the assert lines ``assert add(2, 3) == 5``,
``!=``, ``is None``, ``in [...]``, ``[...] in``, ``math.isclose(...)``, ``abs(x - y) < tol``,
``assert f(x)``, ``assert not f(x)``, ``a and b``.

The solution owns its interpreter, so it can write lines of its own, patch the encoder, ``json``
or ``sys.stdout``, or exit early. What it writes is then only a *claim* about an expression's
value: it passes only if it equals an expected value the solution has never seen, which is
solving the problem. Two lines for one expression void the run (else it could claim every value),
a missing line fails its test, and an early exit leaves lines missing. The line's nonce only keeps
the solution's ordinary prints from being mistaken for results.

What the harness trusts: the row's tests (parsed here, never run here). What it cannot tell apart:
a solution that computes the right values by any means, including special-casing the expressions
it can read in the jail; and a bare ``assert f(x)`` / ``assert not f(x)`` check only that the
reply's function returned ``True`` / ``False``, so a set of tests that are all ``assert f(x)``
passes a ``return True``, exactly as it did before.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import time
from typing import Any

from envs.rewards.code_tests import CHECKS, Case, parse_tests
from envs.rewards.errors import RewardError

_DEPTH = 64


# ---------------------------------------------------------------- values out of the jail


def decode(value: Any, depth: int = 0) -> Any:
    """The plain value a result line encodes (the evaluator's ``enc``); ValueError otherwise."""
    if depth > _DEPTH:
        raise ValueError("nested too deeply")
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [decode(v, depth + 1) for v in value]
    if type(value) is not dict or set(value) != {"$", "v"}:
        raise ValueError("not an encoded value")
    tag, body = value["$"], value["v"]
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError("not an encoded value")
    items = [decode(v, depth + 1) for v in body]
    if tag == "tuple":
        return tuple(items)
    if tag in ("set", "frozenset"):
        return (set if tag == "set" else frozenset)(items)  # TypeError for unhashable items
    if tag == "dict" and all(type(p) is list and len(p) == 2 for p in items):
        return {k: v for k, v in items}
    raise ValueError(f"unknown tag {tag!r}")


def _as_json(value: Any) -> Any:
    """``value`` as JSON would hold it (a tuple is a list): what a ``{"call", "expect"}`` row means."""
    if type(value) in (list, tuple):
        return [_as_json(v) for v in value]
    if type(value) is dict:
        return {k: _as_json(v) for k, v in value.items()}
    return value


def passes(case: Case, value: Any) -> bool:
    """The check of ``case`` on a decoded (plain, built-in) value, made here. Truth checks pass
    only a plain bool: ``assert f(x)`` fails a 1, a non-empty list or "yes"."""
    c, want = case.check, case.expected
    if case.as_json:
        value = _as_json(value)
    if c == "eq":
        return bool(value == want)
    if c == "ne":
        return bool(value != want)
    if c in ("truthy", "is_true"):
        return value is True
    if c in ("falsy", "is_false"):
        return value is False
    if c in ("is_none", "is_not_none"):
        return (value is None) == (c == "is_none")
    if c in ("in", "not_in", "contains", "not_contains"):
        try:
            found = value in want if c in ("in", "not_in") else want in value
        except TypeError:
            return False
        return bool(found) == (c in ("in", "contains"))
    if c == "close":
        ok = all(type(v) in (int, float) for v in (value, want))
        return ok and math.isclose(value, want, rel_tol=case.rel_tol, abs_tol=case.abs_tol)
    raise ValueError(f"unknown check {c!r} (known: {', '.join(CHECKS)})")


@dataclasses.dataclass
class Graded:
    """What the jail's output amounts to: tests passed, why the run is void (or None), and the
    tests whose value was not plain data (index, type name), which the caller reports."""

    passed: int
    void: str | None = None
    non_plain: list[tuple[int, str]] = dataclasses.field(default_factory=list)


def grade(output: str, nonce: str, cases: list[Case]) -> tuple[int, str | None]:
    """``(tests passed, why the run is void or None)`` from the jail's output."""
    graded = grade_output(output, nonce, cases)
    return graded.passed, graded.void


def grade_output(output: str, nonce: str, cases: list[Case]) -> Graded:
    """The ``Graded`` of the jail's output: its result lines decoded strictly and checked here."""
    values: dict[int, Any] = {}
    failed: set[int] = set()
    non_plain = []
    for line in output.splitlines():
        if not line.startswith(nonce):
            continue
        try:
            frame = json.loads(line[len(nonce):])
        except (ValueError, RecursionError):
            return Graded(0, "a malformed result line")
        if not isinstance(frame, dict):
            return Graded(0, "a malformed result line")
        if "import_error" in frame:
            return Graded(0, f"the solution did not import ({str(frame['import_error'])[:200]})")
        i = frame.get("i")
        if type(i) is not int or not 0 <= i < len(cases):
            return Graded(0, "a result line for no test")
        if i in values or i in failed:
            return Graded(0, f"two result lines for test {i}")
        if "v" in frame:
            try:
                values[i] = decode(frame["v"])
            except (ValueError, TypeError, RecursionError):
                failed.add(i)
        else:
            failed.add(i)
            if isinstance(frame.get("np"), str):
                non_plain.append((i, frame["np"][:60]))
    passed = 0
    for i, case in enumerate(cases):
        if i in values:
            try:
                passed += passes(case, values[i])
            except (TypeError, ValueError, OverflowError, RecursionError):
                pass
    return Graded(passed, None, non_plain)


# ---------------------------------------------------------------- the jail side

# Runs under the jail's /usr/bin/python3 (standard library only): ``python3 -I .mixrl_eval.py NONCE``.
EVALUATOR = r'''
import json, os, sys, types
NONCE = sys.argv[1]
OUT = os.dup(1)
LIMIT = 65536

def emit(frame):
    data = ("\n" + NONCE + json.dumps(frame) + "\n").encode()
    while data:
        data = data[os.write(OUT, data):]

def enc(v, depth=0):
    if depth > 60:
        raise ValueError("nested too deeply")
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if t is list:
        return [enc(x, depth + 1) for x in v]
    if t in (tuple, set, frozenset):
        items = sorted(v, key=repr) if t is not tuple else v
        return {"$": t.__name__, "v": [enc(x, depth + 1) for x in items]}
    if t is dict:
        return {"$": "dict", "v": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"$": "bytes", "v": v.hex()}
    if t.__module__ == "numpy" and hasattr(v, "item") and getattr(v, "shape", None) == ():
        return enc(v.item(), depth + 1)
    raise NotPlain(t.__name__)

class NotPlain(Exception):
    pass

with open("/work/.mixrl_cases.json") as f:
    CASES = json.load(f)
solution = types.ModuleType("solution")
solution.__file__ = "/work/solution.py"
sys.modules["solution"] = solution
try:
    with open("/work/solution.py") as f:
        exec(compile(f.read(), "solution.py", "exec"), solution.__dict__)
    ns = dict(solution.__dict__)
    for stmt in CASES["imports"]:
        exec(stmt, ns)
except BaseException as e:
    emit({"import_error": ("%s: %s" % (type(e).__name__, e))[:300]})
    os._exit(0)
for i, expr in enumerate(CASES["exprs"]):
    try:
        text = json.dumps(enc(eval(expr, ns)))
        frame = {"i": i, "v": json.loads(text)} if len(text) <= LIMIT else {"i": i, "e": "value too large"}
    except NotPlain as e:
        frame = {"i": i, "np": str(e)[:60]}
    except BaseException as e:
        frame = {"i": i, "e": ("%s: %s" % (type(e).__name__, e))[:200]}
    emit(frame)
os._exit(0)
'''


def run_tests(program: str, tests: str | list, *, wall_seconds: float = 5.0, cpu_seconds: int = 5) -> dict:
    """``{"reward": 1.0 if every test passes else 0.0, "tests_passed": fraction}`` of ``program``
    against the row's ``tests``, run in a fresh sandbox."""
    from envs.rewards.limits import DEADLINE_ENV
    from envs.sandbox import Sandbox, SandboxLimits

    imports, cases = parse_tests(tests)  # a bad row is an error before any sandbox starts
    deadline = os.environ.get(DEADLINE_ENV)  # the reward call's own timeout: end the sandbox first
    if deadline:
        wall_seconds = max(0.5, min(wall_seconds, float(deadline) - time.time() - 1.0))
        cpu_seconds = max(1, min(cpu_seconds, math.ceil(wall_seconds)))
    nonce = "@@mixrl-" + secrets.token_hex(8)
    limits = SandboxLimits(wall_seconds=wall_seconds, cpu_seconds=cpu_seconds, max_output_bytes=512 * 1024)
    with Sandbox(limits) as box:
        box.write_file("solution.py", program)
        exprs = [c.expr for c in cases]
        box.write_file(".mixrl_cases.json", json.dumps({"imports": imports, "exprs": exprs}))
        box.write_file(".mixrl_eval.py", EVALUATOR)
        result = box.run(f"exec /usr/bin/python3 -I .mixrl_eval.py {nonce}")
    graded = grade_output(result.output, nonce, cases)
    if graded.non_plain and graded.void is None:
        i, kind = graded.non_plain[0]
        raise RewardError("non_plain_value", f"test {i} ({cases[i].expr[:80]!r}) gave a {kind}, not plain "
                          f"data ({len(graded.non_plain)} of {len(cases)} tests)")
    return {"reward": float(graded.void is None and graded.passed == len(cases)),
            "tests_passed": 0.0 if graded.void else graded.passed / len(cases)}
