"""The ``code`` reward's tests, read: each becomes an expression for the jail and a check kept here.

A row's ``tests`` is a string or a list of lines, ``assert`` statements and imports, and, in a
list, objects of the recommended form ``{"call": "add(2, 3)", "expect": 5}`` (``abs_tol`` /
``rel_tol`` make it an ``isclose``). The forms read, with what enters the jail:

- ``assert E == v``, ``!=``, ``E in v``, ``v in E``, ``math.isclose(E, v)``, ``abs(E - v) < t``,
  ``E is None`` / ``is not None``: ``E`` only; ``v`` (a literal) stays here;
- ``assert E``, ``assert not E``, ``E is True`` / ``is False`` (and ``== True`` ...): truth checks,
  passed only by a plain ``True`` / ``False``, and ``E`` must be a call of the reply's own code
  (``f(x)``, ``Stack().empty()``), not of a builtin or an imported library whose result the reply
  could arrange (``all``, ``bool``, ``isinstance``, ``math.isclose``);
- ``a and b``: two tests.

Nothing that would compare inside the jail is accepted, whatever the form around it: a
comparison, ``and`` / ``or``, ``not``, a conditional expression, a walrus, a dunder attribute or
a builtin's or an import's comparing function (``all``, ``any``, ``bool``, ``isinstance``,
``math.isclose``, ``operator.eq``, ``min`` / ``max`` of several values ...) anywhere in ``E`` is
refused as
``unsupported_test`` (``envs.rewards.errors.RewardError``): the reply owns that interpreter, so a
comparison made there (``(add(2, 3) == 5) == True`` with an always-equal object, ``all(...)`` with
``builtins.all`` patched) would be its verdict, not ours.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

from envs.rewards.errors import RewardError

CHECKS = ("eq", "ne", "truthy", "falsy", "is_none", "is_not_none", "is_true", "is_false", "close",
          "in", "not_in", "contains", "not_contains")
# Functions that compare or test their arguments: called in the jail, the reply decides them.
COMPARERS = frozenset({
    "all", "any", "bool", "isinstance", "issubclass", "callable", "hasattr", "isclose", "allclose",
    "array_equal", "array_equiv", "equal", "not_equal", "eq", "ne", "lt", "le", "gt", "ge", "is_",
    "is_not", "not_", "truth", "contains", "assert_equal", "assert_allclose", "assertEqual",
    "assertTrue", "assertFalse", "match", "fullmatch", "search", "startswith", "endswith"})
# Third-party libraries a test may import (their functions are not the reply's own code).
LIBRARIES = frozenset({"numpy", "scipy", "pandas", "sympy", "torch", "pytest", "hypothesis", "networkx"})
_REFUSED = (ast.Compare, ast.BoolOp, ast.IfExp, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)
_BUILTIN_NAMES = frozenset(dir(builtins))


@dataclasses.dataclass(frozen=True)
class Case:
    """One assert: the expression evaluated in the jail and the check applied to its value here."""

    expr: str
    check: str
    expected: Any = None
    rel_tol: float = 1e-9
    abs_tol: float = 0.0
    line: int = 0
    as_json: bool = False  # a ``{"call", "expect"}`` row: the value's tuples compare as JSON lists


def _unsupported(message: str) -> RewardError:
    return RewardError("unsupported_test", message)


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _callee(func: ast.expr) -> str:
    """The last name of a call's target (``math.isclose`` -> ``isclose``)."""
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _root(node: ast.expr) -> ast.expr:
    """The name (or other node) a chain of attributes and calls starts from: ``Stack().pop`` -> ``Stack``."""
    while isinstance(node, ast.Attribute | ast.Call):
        node = node.value if isinstance(node, ast.Attribute) else node.func
    return node


def _reply_call(node: ast.expr, foreign: Mapping[str, str]) -> bool:
    """Whether ``node`` is a call of the reply's own code: ``f(x)``, ``Stack().pop()``, ``f(x).y()``,
    rooted at a name that is neither a builtin nor one of the tests' imports."""
    root = _root(node)
    return isinstance(node, ast.Call) and isinstance(root, ast.Name) and root.id not in _BUILTIN_NAMES \
        and root.id not in foreign


def check_jail_expr(node: ast.expr, foreign: Mapping[str, str] | None = None) -> None:
    """``unsupported_test`` if evaluating ``node`` in the jail would compare anything there: a
    comparison, ``and`` / ``or`` / ``not``, a conditional, a walrus, a dunder attribute, or a
    comparing function (``COMPARERS``, ``min`` / ``max`` of several values) of a builtin or an
    import (the reply's own functions may have any name; an import's alias counts as its name)."""
    foreign = foreign or {}
    for sub in ast.walk(node):
        if isinstance(sub, _REFUSED) or (isinstance(sub, ast.UnaryOp) and isinstance(sub.op, ast.Not)):
            raise _unsupported(f"{ast.unparse(node)!r} would compare inside the sandbox "
                               f"({type(sub).__name__}): compare with a literal at the top level")
        if isinstance(sub, ast.Attribute) and sub.attr.startswith("__"):
            raise _unsupported(f"{ast.unparse(node)!r} uses the attribute {sub.attr!r}")
        if isinstance(sub, ast.Call) and not _reply_call(sub, foreign):
            name = _callee(sub.func)
            name = foreign.get(name, name) if isinstance(sub.func, ast.Name) else name
            if name in COMPARERS or (name in ("min", "max") and len(sub.args) + len(sub.keywords) > 1):
                raise _unsupported(f"{ast.unparse(node)!r} calls {name}, which would compare inside "
                                   "the sandbox")


class _Reader:
    """Reads one row's tests; ``foreign`` are the names its imports bind (not the reply's)."""

    def __init__(self, foreign: Mapping[str, str]):
        self.foreign = foreign

    def expr(self, node: ast.expr) -> str:
        check_jail_expr(node, self.foreign)
        return ast.unparse(node)

    def truth(self, node: ast.expr, check: str, line: int) -> Case:
        """A truth check: only a plain bool from a call of the reply's own code passes."""
        expr = self.expr(node)
        if not _reply_call(node, self.foreign):
            raise _unsupported(f"a truth check of {expr!r}: assert a call of the solution's own "
                               "function (f(x)), or compare its value with a literal")
        return Case(expr, check, line=line)

    def cases(self, test: ast.expr, line: int) -> list[Case]:
        """The checks of one assert's test expression (``a and b`` gives two)."""
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            return [c for v in test.values for c in self.cases(v, line)]
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return [self.truth(test.operand, "falsy", line)]
        if isinstance(test, ast.Call) and ast.unparse(test.func) in ("isclose", "math.isclose") \
                and len(test.args) == 2:
            return [self.pair(test.args[0], test.args[1], "close", line, **_tolerance(test))]
        if isinstance(test, ast.Compare):
            return [self.compare(test, line)]
        if _literal(test)[0]:
            raise ValueError(f"asserts a constant ({ast.unparse(test)!r})")
        return [self.truth(test, "truthy", line)]

    def compare(self, test: ast.Compare, line: int) -> Case:
        if len(test.ops) != 1:
            raise _unsupported("a chained comparison: write one comparison per assert")
        op, left, right = test.ops[0], test.left, test.comparators[0]
        bools = {(ast.Eq, True): "is_true", (ast.Eq, False): "is_false", (ast.NotEq, True): "is_false",
                 (ast.NotEq, False): "is_true", (ast.Is, True): "is_true", (ast.Is, False): "is_false",
                 (ast.IsNot, True): "is_false", (ast.IsNot, False): "is_true"}
        for a, b in ((left, right), (right, left)):
            if isinstance(b, ast.Constant) and type(b.value) is bool and not _literal(a)[0] \
                    and (type(op), b.value) in bools:
                return self.truth(a, bools[type(op), b.value], line)  # == True is a truth check
        if isinstance(op, ast.Eq | ast.NotEq):
            return self.pair(left, right, "eq" if isinstance(op, ast.Eq) else "ne", line)
        if isinstance(op, ast.Is | ast.IsNot) and isinstance(right, ast.Constant) and right.value is None:
            return Case(self.expr(left), "is_none" if isinstance(op, ast.Is) else "is_not_none", line=line)
        if isinstance(op, ast.In | ast.NotIn):
            negated = isinstance(op, ast.NotIn)
            ok_right, container = _literal(right)
            if ok_right and not _literal(left)[0]:
                return Case(self.expr(left), "not_in" if negated else "in", container, line=line)
            ok_left, item = _literal(left)
            if ok_left and not ok_right:
                return Case(self.expr(right), "not_contains" if negated else "contains", item, line=line)
            raise _unsupported("one side of 'in' must be a literal")
        if isinstance(op, ast.Lt | ast.LtE) and isinstance(left, ast.Call) \
                and ast.unparse(left.func) == "abs" and len(left.args) == 1 \
                and isinstance(left.args[0], ast.BinOp) and isinstance(left.args[0].op, ast.Sub):
            ok, tol = _literal(right)
            if ok and isinstance(tol, int | float) and not isinstance(tol, bool):
                diff = left.args[0]
                return self.pair(diff.left, diff.right, "close", line, rel_tol=0.0, abs_tol=float(tol))
        raise _unsupported(f"unsupported comparison {ast.unparse(test)!r}: use ==, !=, is None, in, "
                           "isclose or abs(x - y) < tol")

    def pair(self, a: ast.expr, b: ast.expr, check: str, line: int, **tol: float) -> Case:
        """``a OP b`` with one side a literal: the other side is evaluated in the jail."""
        ok_b, value_b = _literal(b)
        ok_a, value_a = _literal(a)
        if ok_b and not ok_a:
            return Case(self.expr(a), check, value_b, line=line, **tol)
        if ok_a and not ok_b:
            return Case(self.expr(b), check, value_a, line=line, **tol)
        raise _unsupported(f"one side of {ast.unparse(a)!r} vs {ast.unparse(b)!r} must be a literal "
                           "(the expected value never enters the jail)")

    def row(self, item: dict, line: int) -> Case:
        """A ``{"call": "f(x)", "expect": value}`` test (``abs_tol`` / ``rel_tol``: isclose)."""
        unknown = set(item) - {"call", "expect", "abs_tol", "rel_tol"}
        if unknown or not isinstance(item.get("call"), str) or "expect" not in item:
            raise ValueError(f"a test object needs 'call' (text) and 'expect' (and optionally abs_tol / "
                             f"rel_tol), got keys {sorted(map(str, item))[:6]}")
        try:
            node = ast.parse(item["call"].strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            raise ValueError(f"'call' does not parse ({type(e).__name__})") from None
        want = item["expect"]
        if type(want) is bool:
            return self.truth(node, "is_true" if want else "is_false", line)
        if want is None:
            return Case(self.expr(node), "is_none", line=line)
        if "abs_tol" in item or "rel_tol" in item:
            tol = {k: item.get(k, 0.0) for k in ("abs_tol", "rel_tol")}
            if not all(type(v) in (int, float) for v in [want, *tol.values()]):
                raise ValueError("an isclose test needs numbers for expect, abs_tol and rel_tol")
            return Case(self.expr(node), "close", want, line=line, **{k: float(v) for k, v in tol.items()})
        return Case(self.expr(node), "eq", want, line=line, as_json=True)


def _tolerance(node: ast.Call) -> dict[str, float]:
    out = {}
    for kw in node.keywords:
        ok, value = _literal(kw.value)
        if kw.arg not in ("rel_tol", "abs_tol") or not ok or not isinstance(value, int | float):
            raise _unsupported(f"isclose takes literal rel_tol / abs_tol, got {ast.unparse(kw)}")
        out[kw.arg] = float(value)
    return out


def _imported_names(tree: ast.Module) -> dict[str, str]:
    """The names the tests' imports bind from libraries (the standard library's modules and
    ``LIBRARIES``), each with the name it stands for (``m`` for ``from re import fullmatch as m``
    stands for ``fullmatch``): not the reply's code. What they import from anything else
    (``solution``, the package a repo task's model edits) is the reply's."""
    names = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0]: a.name for a in node.names if _library(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _library(node.module or ""):
            names |= {a.asname or a.name: a.name for a in node.names}
    return names


def _library(module: str) -> bool:
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or top in LIBRARIES


def parse_tests(tests: str | list) -> tuple[list[str], list[Case]]:
    """``(imports, cases)`` of a row's ``tests``: ``assert`` statements and imports (a string or a
    list of lines) and ``{"call", "expect"}`` objects (in a list); ValueError naming the line for a
    malformed row, ``RewardError("unsupported_test")`` for a test that would compare in the jail."""
    items = [tests] if isinstance(tests, str) else list(tests)
    lines = [str(t) for t in items if not isinstance(t, dict)]
    source = "\n".join(lines)
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"code reward: the row's tests do not parse (line {e.lineno}: {e.msg})") from None
    except (RecursionError, MemoryError, ValueError) as e:
        raise ValueError(f"code reward: the row's tests do not parse ({type(e).__name__})") from None
    reader = _Reader(_imported_names(tree))
    imports, cases = [], []
    for node in tree.body:
        try:
            if isinstance(node, ast.Import | ast.ImportFrom):
                imports.append(ast.unparse(node))
            elif isinstance(node, ast.Assert):
                cases += reader.cases(node.test, node.lineno)
            else:
                raise ValueError("only assert statements and imports are supported, "
                                 f"not {type(node).__name__}")
        except RewardError as e:
            raise RewardError(e.reason, f"code reward: tests line {node.lineno}: "
                              f"{str(e).partition(': ')[2]}") from None
        except ValueError as e:
            raise ValueError(f"code reward: tests line {node.lineno}: {e}") from None
    for n, item in enumerate(t for t in items if isinstance(t, dict)):
        try:
            cases.append(reader.row(item, 0))
        except RewardError as e:
            why = str(e).partition(": ")[2]
            raise RewardError(e.reason, f"code reward: test object {n}: {why}") from None
        except ValueError as e:
            raise ValueError(f"code reward: test object {n}: {e}") from None
    if not cases:
        raise ValueError("code reward: the row's tests hold no assert")
    return imports, cases


__all__ = ["CHECKS", "COMPARERS", "LIBRARIES", "Case", "check_jail_expr", "parse_tests"]
