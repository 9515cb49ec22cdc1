"""Built-in rewards, called by keyword like a user's: ``math``, ``exact`` and ``code``.

- ``math``: the final answer of the reply (the last ``\\boxed{...}``, else a ``#### ...`` line)
  against the row's answer (its ``#### ...`` part for GSM8K-style answers), equal as numbers or,
  failing that, as sympy expressions.
- ``exact``: the reply, stripped, equals the answer, stripped.
- ``code``: the reply's last fenced Python block (or the whole reply) is imported in the
  namespace sandbox, the expressions of the row's ``tests`` (a string, or a list of ``assert``
  lines: ``assert f(x) == 3``, ``!=``, ``is None``, ``in [...]``, ``isclose``, ``abs(a - b) < t``,
  ``assert f(x)``, ``assert not f(x)``, imports) are evaluated there, and their values are
  compared outside it with the expected values, which never enter the sandbox
  (``envs.rewards.code_harness`` says why and what it trusts); 1 when every test passes, with
  ``tests_passed`` (the fraction) as a metric.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

# Built-in reward names and the functions they stand for.
BUILTINS = {"math": "envs.rewards.builtin:math_reward", "exact": "envs.rewards.builtin:exact_reward",
            "code": "envs.rewards.builtin:code_reward"}
# Modules a built-in imports lazily, imported once by the reward worker (``envs.rewards.worker``)
# so that the per-call processes it forks start with them loaded.
WARM = {"math": ("sympy", "sympy.parsing.sympy_parser"),
        "code": ("envs.sandbox", "envs.rewards.code_harness")}
# Built-ins whose calls run in the worker itself, not in a process forked per call: code we wrote
# that neither forks nor writes to descriptors, where a fork (tens of ms, and sympy's caches cold
# in every child) would cost more than the call (``envs.rewards.worker.Supervisor.call_inline``).
INLINE = ("math", "exact")
_HASHES = re.compile(r"####\s*(.+)")
_FENCE = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)```", re.DOTALL)


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j]
    return None


def final_answer(text: str) -> str | None:
    """The reply's final answer: the last ``\\boxed{}``, else the last ``#### ...`` line."""
    found = boxed(text)
    if found is None:
        lines = _HASHES.findall(text)
        found = lines[-1] if lines else None
    return None if found is None else found.strip()


def _clean(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    for junk in ("\\!", "\\,", "\\;", "\\left", "\\right", "\\%", "%", "\\$", "dfrac"):
        s = s.replace(junk, "frac" if junk == "dfrac" else "")
    s = s.replace(",", "") if re.fullmatch(r"[-+]?[\d,]+(\.\d+)?", s.replace(" ", "")) else s
    return s.rstrip(".").strip()


def _number(s: str) -> Fraction | None:
    try:
        return Fraction(s.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _sympy(s: str):
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    previous = None
    while previous != s:  # innermost first, so nested fractions and roots unwind
        previous = s
        s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
        s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "pi")
    s = s.replace("{", "(").replace("}", ")")
    # parse_expr evaluates Python: only arithmetic over names and numbers gets that far.
    if len(s) > 200 or not re.fullmatch(r"[0-9A-Za-z+\-*/^().\s]*", s):
        raise ValueError(f"not a plain expression: {s[:40]!r}")
    # "2x" and "x^2" as written in answers.
    rules = (*standard_transformations, implicit_multiplication_application, convert_xor)
    return parse_expr(s, transformations=rules, evaluate=True)


def answers_match(got: str, want: str) -> bool:
    """Equal as strings, as exact numbers, or as sympy expressions (their difference simplifies to 0)."""
    got, want = _clean(got), _clean(want)
    if got == want:
        return True
    a, b = _number(got), _number(want)
    if a is not None and b is not None:
        return a == b
    try:
        import sympy

        return bool(sympy.simplify(_sympy(got) - _sympy(want)) == 0)
    except Exception:  # noqa: BLE001 - unparsable text is simply not a match
        return False


def math_reward(*, completion: str, answer: Any, prompt: str = "", task: dict | None = None) -> float:
    if answer is None:
        raise ValueError("math reward: the row has no answer (set options.answer_key)")
    want = str(answer)
    want = (_HASHES.findall(want) or [want])[-1]
    got = final_answer(completion)
    return float(got is not None and answers_match(got, want))


def exact_reward(*, completion: str, answer: Any, prompt: str = "", task: dict | None = None) -> float:
    if answer is None:
        raise ValueError("exact reward: the row has no answer (set options.answer_key)")
    return float(completion.strip() == str(answer).strip())


def code_reward(*, completion: str, answer: Any = None, prompt: str = "", task: dict | None = None) -> dict:
    from envs.rewards.code_harness import run_tests

    tests = (task or {}).get("tests")
    if not tests:
        raise ValueError("code reward: the row has no 'tests'")
    blocks = _FENCE.findall(completion)
    return run_tests(blocks[-1] if blocks else completion, tests)
