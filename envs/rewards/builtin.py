"""Built-in rewards, called by keyword like a user's: ``math``, ``exact`` and ``code``.

- ``math``: the final answer of the reply (the last ``\\boxed{...}``, else a ``#### ...`` line)
  against the row's answer (its ``#### ...`` part for GSM8K-style answers), equal as written or as
  values read by ``envs.rewards.math_answer`` / ``math_values`` (a grammar of our own: the reply
  is parsed, never evaluated as code; what it cannot read is ``unparseable`` and scores 0).
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
from typing import Any

# Built-in reward names and the functions they stand for.
BUILTINS = {"math": "envs.rewards.builtin:math_reward", "exact": "envs.rewards.builtin:exact_reward",
            "code": "envs.rewards.builtin:code_reward"}
# Modules a built-in imports lazily, imported once by the reward worker (``envs.rewards.worker``)
# so that the per-call processes it forks start with them loaded.
WARM = {"math": ("mpmath", "envs.rewards.math_values"),
        "code": ("envs.sandbox", "envs.rewards.code_harness")}
_HASHES = re.compile(r"####\s*(.+)")
_BRACES = re.compile(r"[{}]")
_MAX_BOX_BRACES = 1 << 16
_FENCE = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)```", re.DOTALL)


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces balanced), or None (unbalanced, or
    over ``_MAX_BOX_BRACES`` braces: no answer is that deep, and the scan stays a few ms)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for n, m in enumerate(_BRACES.finditer(text, i)):  # a regex skips what lies between braces
        if n >= _MAX_BOX_BRACES:
            return None
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return text[i + 1: m.start()]
    return None


def final_answer(text: str) -> str | None:
    """The reply's final answer: the last ``\\boxed{}``, else the last ``#### ...`` line."""
    found = boxed(text)
    if found is None:
        lines = _HASHES.findall(text)
        found = lines[-1] if lines else None
    return None if found is None else found.strip()


def answers_match(got: str, want: str) -> bool:
    """Equal as written (spacing and wrappers aside) or as values read by our own parser
    (``envs.rewards.math_answer``: exact fractions, symbols, roots, pi); text it cannot read is
    ``unparseable`` and matches nothing but the same text."""
    from envs.rewards.math_answer import normalise
    from envs.rewards.math_values import answers_equal

    try:
        a, b = normalise(got), normalise(want)
        if a and "".join(a.split()) == "".join(b.split()):
            return True
        return answers_equal(got, want)
    except Exception:  # noqa: BLE001 - hostile text we fail to read (any way) is not a match
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
