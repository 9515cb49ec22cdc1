"""The ``code`` reward's harness: the row's asserts become values read out of the solution in the
jail and compared here, outside it, with expected values that never enter the jail.

Why not run the asserts after the solution, as before: then the verdict is the exit status of a
process the solution controls (``os._exit(0)``, ``sys.exit(0)``, an ``atexit`` or excepthook that
exits 0 all "passed"), and so is every comparison made in it (an object whose ``__eq__`` is always
true, a patched ``builtins`` or ``unittest``). Whatever runs in the solution's interpreter can be
subverted by it, so nothing there decides anything:

- ``parse_tests`` splits each ``assert`` with ``ast`` into the expression to evaluate (``add(2, 3)``)
  and a check kept on this side (``== 5``, ``ast.literal_eval``): only the expressions and the
  test's imports go into the jail;
- in the jail, ``EVALUATOR`` imports the solution as a module, evaluates each expression and writes
  one line per expression, ``<nonce>{"i": n, "v": <value>}``, with the value encoded as plain data
  (None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset, exact types only; numpy
  scalars as their ``item()``): an always-equal object or an ``int`` subclass cannot be encoded, so
  that expression fails;
- here, ``grade`` decodes each line strictly into fresh built-in values and runs the check.

The solution owns its interpreter, so it can write lines of its own, patch the encoder, ``json``
or ``sys.stdout``, or exit early. What it writes is then only a *claim* about an expression's
value: it passes only if it equals an expected value the solution has never seen, which is
solving the problem. Two lines for one expression void the run (else it could claim every value),
a missing line fails its test, and an early exit leaves lines missing. The line's nonce only keeps
the solution's ordinary prints from being mistaken for results.

What the harness trusts: the row's tests (parsed here, never run here). What it cannot tell apart:
a solution that computes the right values by any means, including special-casing the expressions
it can read in the jail; and a bare ``assert f(x)`` / ``assert not f(x)`` check only the truth of
the value, so a set of tests that are all ``assert f(x)`` passes a ``return True``, exactly as it
did before.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import secrets
import time
from typing import Any

_DEPTH = 64
_CHECKS = ("eq", "ne", "truthy", "falsy", "is_none", "is_not_none", "is_true", "is_false", "close",
           "in", "not_in")


@dataclasses.dataclass(frozen=True)
class Case:
    """One assert: the expression evaluated in the jail and the check applied to its value here."""

    expr: str
    check: str
    expected: Any = None
    rel_tol: float = 1e-9
    abs_tol: float = 0.0
    line: int = 0


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _tolerance(node: ast.Call) -> dict[str, float]:
    out = {}
    for kw in node.keywords:
        ok, value = _literal(kw.value)
        if kw.arg not in ("rel_tol", "abs_tol") or not ok or not isinstance(value, int | float):
            raise ValueError(f"isclose takes literal rel_tol / abs_tol, got {ast.unparse(kw)}")
        out[kw.arg] = float(value)
    return out


def _case(test: ast.expr, line: int) -> list[Case]:
    """The checks of one assert's test expression (``a and b`` gives two)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return [c for v in test.values for c in _case(v, line)]
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return [Case(_expr(test.operand), "falsy", line=line)]
    if isinstance(test, ast.Call) and ast.unparse(test.func) in ("isclose", "math.isclose") \
            and len(test.args) == 2:
        return [_pair(test.args[0], test.args[1], "close", line, **_tolerance(test))]
    if isinstance(test, ast.Compare):
        if len(test.ops) != 1:
            raise ValueError("a chained comparison: write one comparison per assert")
        op, left, right = test.ops[0], test.left, test.comparators[0]
        if isinstance(op, ast.Eq | ast.NotEq):
            return [_pair(left, right, "eq" if isinstance(op, ast.Eq) else "ne", line)]
        if isinstance(op, ast.Is | ast.IsNot) and isinstance(right, ast.Constant) \
                and any(right.value is c for c in (None, True, False)):
            name = {None: "none", True: "true", False: "false"}[right.value]
            check = f"is_{name}" if isinstance(op, ast.Is) else f"is_not_{name}"
            if check not in _CHECKS:
                raise ValueError(f"unsupported check {ast.unparse(test)!r}")
            return [Case(_expr(left), check, line=line)]
        if isinstance(op, ast.In | ast.NotIn):
            ok, expected = _literal(right)
            if not ok:
                raise ValueError("the right side of 'in' must be a literal")
            return [Case(_expr(left), "in" if isinstance(op, ast.In) else "not_in", expected, line=line)]
        if isinstance(op, ast.Lt | ast.LtE) and isinstance(left, ast.Call) \
                and ast.unparse(left.func) == "abs" and len(left.args) == 1 \
                and isinstance(left.args[0], ast.BinOp) and isinstance(left.args[0].op, ast.Sub):
            ok, tol = _literal(right)
            if ok and isinstance(tol, int | float) and not isinstance(tol, bool):
                diff = left.args[0]
                return [_pair(diff.left, diff.right, "close", line, rel_tol=0.0, abs_tol=float(tol))]
        raise ValueError(f"unsupported comparison {ast.unparse(test)!r}: use ==, !=, is None, in, "
                         "isclose or abs(x - y) < tol")
    if _literal(test)[0]:
        raise ValueError(f"asserts a constant ({ast.unparse(test)!r})")
    return [Case(_expr(test), "truthy", line=line)]


def _pair(a: ast.expr, b: ast.expr, check: str, line: int, **tol: float) -> Case:
    """``a OP b`` with one side a literal: the other side is evaluated in the jail."""
    ok_b, value_b = _literal(b)
    ok_a, value_a = _literal(a)
    if ok_b and not ok_a:
        return Case(_expr(a), check, value_b, line=line, **tol)
    if ok_a and not ok_b:
        return Case(_expr(b), check, value_a, line=line, **tol)
    raise ValueError(f"one side of {ast.unparse(a)!r} vs {ast.unparse(b)!r} must be a literal "
                     "(the expected value never enters the jail)")


def _expr(node: ast.expr) -> str:
    return ast.unparse(node)


def parse_tests(tests: str | list) -> tuple[list[str], list[Case]]:
    """``(imports, cases)`` of a row's ``tests`` (a string or a list of lines): ``assert``
    statements and imports only; ValueError naming the line for anything else."""
    source = tests if isinstance(tests, str) else "\n".join(str(t) for t in tests)
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"code reward: the row's tests do not parse (line {e.lineno}: {e.msg})") from None
    imports, cases = [], []
    for node in tree.body:
        try:
            if isinstance(node, ast.Import | ast.ImportFrom):
                imports.append(ast.unparse(node))
            elif isinstance(node, ast.Assert):
                cases += _case(node.test, node.lineno)
            else:
                raise ValueError("only assert statements and imports are supported, "
                                 f"not {type(node).__name__}")
        except ValueError as e:
            raise ValueError(f"code reward: tests line {node.lineno}: {e}") from None
    if not cases:
        raise ValueError("code reward: the row's tests hold no assert")
    return imports, cases


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


def passes(case: Case, value: Any) -> bool:
    """The check of ``case`` on a decoded (plain, built-in) value, made here."""
    c, want = case.check, case.expected
    if c == "eq":
        return bool(value == want)
    if c == "ne":
        return bool(value != want)
    if c in ("truthy", "falsy"):
        return bool(value) == (c == "truthy")
    if c in ("is_none", "is_not_none"):
        return (value is None) == (c == "is_none")
    if c in ("is_true", "is_false"):
        return value is (c == "is_true")
    if c in ("in", "not_in"):
        try:
            return (value in want) == (c == "in")
        except TypeError:
            return False
    if c == "close":
        ok = all(type(v) in (int, float) for v in (value, want))
        return ok and math.isclose(value, want, rel_tol=case.rel_tol, abs_tol=case.abs_tol)
    raise ValueError(f"unknown check {c!r}")


def grade(output: str, nonce: str, cases: list[Case]) -> tuple[int, str | None]:
    """``(tests passed, why the run is void or None)`` from the jail's output."""
    values: dict[int, Any] = {}
    failed: set[int] = set()
    for line in output.splitlines():
        if not line.startswith(nonce):
            continue
        try:
            frame = json.loads(line[len(nonce):])
        except (ValueError, RecursionError):
            return 0, "a malformed result line"
        if not isinstance(frame, dict):
            return 0, "a malformed result line"
        if "import_error" in frame:
            return 0, f"the solution did not import ({str(frame['import_error'])[:200]})"
        i = frame.get("i")
        if type(i) is not int or not 0 <= i < len(cases):
            return 0, "a result line for no test"
        if i in values or i in failed:
            return 0, f"two result lines for test {i}"
        if "v" in frame:
            try:
                values[i] = decode(frame["v"])
            except (ValueError, TypeError, RecursionError):
                failed.add(i)
        else:
            failed.add(i)
    passed = 0
    for i, case in enumerate(cases):
        if i in values:
            try:
                passed += passes(case, values[i])
            except (TypeError, ValueError, OverflowError, RecursionError):
                pass
    return passed, None


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
    raise TypeError("a %s is not plain data" % t.__name__)

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
    except BaseException as e:
        frame = {"i": i, "e": ("%s: %s" % (type(e).__name__, e))[:200]}
    emit(frame)
os._exit(0)
'''


def run_tests(program: str, tests: str | list, *, wall_seconds: float = 5.0, cpu_seconds: int = 5) -> dict:
    """``{"reward": 1.0 if every test passes else 0.0, "tests_passed": fraction}`` of ``program``
    against the row's ``tests``, run in a fresh sandbox."""
    from envs.rewards import DEADLINE_ENV
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
    passed, void = grade(result.output, nonce, cases)
    return {"reward": float(void is None and passed == len(cases)),
            "tests_passed": 0.0 if void else passed / len(cases)}
