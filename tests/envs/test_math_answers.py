"""The ``math`` reward parses answers with a grammar of its own and never evaluates a reply (issue 44
item 1; issue 46's ``0.33`` for ``1/3`` survivor).

Tables of real answer pairs (GSM8K / MATH styles: fractions, decimals, LaTeX, units, negatives,
thousands separators, scientific notation, near misses), hostile payloads that must score 0 fast
without running anything, and the exact values checked against Fraction arithmetic done here."""

from __future__ import annotations

import builtins
import random
import time
from fractions import Fraction

import pytest

from envs.rewards import RewardPool, math_answer, math_values
from envs.rewards.builtin import answers_match, math_reward
from envs.rewards.math_answer import MAX_BITS, MAX_DEPTH, Unparseable
from envs.rewards.math_values import MAX_EXPONENT, answers_equal

# (the reply's final answer, the row's answer, match?)
PAIRS = [
    # equal as numbers
    ("72", "#### 72", True),
    ("1,000", "1000", True),
    ("1,234,567", "1234567", True),
    ("1{,}234", "1234", True),
    ("10.0", "10", True),
    ("0.50", "\\frac{1}{2}", True),
    ("\\frac{1}{2}", "0.5", True),
    ("1/2", "\\dfrac{1}{2}", True),
    ("\\tfrac34", "0.75", True),
    ("-\\frac{1}{2}", "-0.5", True),
    ("\\frac{-3}{4}", "-0.75", True),
    ("-7", "#### -7", True),
    ("6.02e23", "6.02\\times10^{23}", True),
    ("1.5 \\cdot 10^{-3}", "0.0015", True),
    ("2^{10}", "1024", True),
    ("\\left(\\frac{1}{2}\\right)^2", "1/4", True),
    ("$\\frac{7}{2}$", "3.5", True),
    # LaTeX and units around the number
    ("\\$12", "12", True),
    ("12 dollars", "12", True),
    ("\\text{12 dollars}", "12", True),
    ("5\\text{ cm}^2", "5", True),
    ("60 km/h", "60", True),
    ("30^\\circ", "30", True),
    ("50\\%", "50", True),
    ("x = 5", "5", True),
    ("18.", "18", True),
    # symbolic and irrational
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("\\frac{\\sqrt{8}}{2}", "\\sqrt{2}", True),
    ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}", True),
    ("\\frac{1}{1+\\sqrt{2}}", "\\sqrt{2}-1", True),
    ("\\sqrt[3]{27}", "3", True),
    ("8^{1/3}", "2", True),
    ("3\\pi", "\\pi\\cdot 3", True),
    ("\\frac{\\pi}{2}", "0.5\\pi", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("(x-1)(x+1)", "x^2 - 1", True),
    ("\\frac{x^2-1}{x-1}", "x+1", True),
    ("(1, 2)", "(1,2)", True),  # not a number: equal as written
    ("(\\sqrt{2}+1)^{64} - (\\sqrt{2}-1)^{-64}", "0", True),  # a cancellation of 25 digits
    ("\\sqrt[3]{-8}", "-2", True),
    ("(-8)^{2/3}", "4", True),
    # near misses
    ("0.33", "\\frac{1}{3}", False),
    ("0.333", "1/3", False),
    ("0.3333333333333333", "1/3", False),
    ("3.14", "\\pi", False),
    ("3.14159265358979323846264338327950288", "\\pi", False),
    ("1.4142135623730951", "\\sqrt{2}", False),
    ("71", "#### 72", False),
    ("-72", "72", False),
    ("50\\%", "0.5", False),  # a percent sign is a unit: 50% is 50
    ("12,34", "1234", False),  # not a thousands separator
    ("3\\frac{1}{2}", "3.5", False),  # ambiguous: a mixed number or 3 x 1/2? refused
    ("x^2+2x", "(x+1)^2", False),
    ("2x", "2y", False),
    ("\\sqrt{2}", "\\sqrt{3}", False),
    ("1e3", "1001", False),
    ("12 dollars and 5 cents", "12", False),
    ("\\pi^{100} + 1", "\\pi^{100}", False),  # equal to 50 significant digits, not past the point
    ("\\pi^{1000} + 1", "\\pi^{1000}", False),  # 497 digits before the point: the precision grows
    ("3.14159265358979323846264338327950288419716939937510582097494459230781640628620899862803482534",
     "\\pi", False),  # 91 digits: compared past them
    ("10^{-50}\\cdot 3.14159", "10^{-50}\\pi", False),  # a near miss among tiny values
    ("42 + \\frac{1}{\\sqrt{2}-\\sqrt{2}}", "42", False),  # a division by what may be 0 is no value
    ("\\sqrt{-4}", "2", False),
]


@pytest.mark.parametrize("got,want,match", PAIRS, ids=[f"{g}|{w}" for g, w, _ in PAIRS])
def test_real_answer_pairs(got, want, match):
    assert math_reward(completion=f"So the answer is \\boxed{{{got}}}.", answer=want) == float(match)
    # The same through a GSM8K-style final line, and symmetric.
    assert math_reward(completion=f"work...\n#### {got}", answer=want) == float(match)
    assert answers_match(want.removeprefix("#### "), got) == match


def _no_code_paths(monkeypatch):
    """Anything that turns text into code, made to fail the test if it is reached."""
    import sympy
    import sympy.core.sympify
    import sympy.parsing.sympy_parser

    def refuse(*a, **k):
        raise AssertionError("text reached a code path")

    for module, name in ((sympy.parsing.sympy_parser, "parse_expr"), (sympy, "sympify"),
                         (sympy.core.sympify, "sympify"), (sympy, "parse_expr")):
        monkeypatch.setattr(module, name, refuse, raising=False)
    real_eval, real_exec = builtins.eval, builtins.exec

    def guarded(real):
        def run(source, *a, **k):  # imports exec code objects; only text is refused
            if isinstance(source, str | bytes):
                raise AssertionError(f"{real.__name__} of text: {source[:60]!r}")
            return real(source, *a, **k)
        return run

    monkeypatch.setattr(builtins, "eval", guarded(real_eval))
    monkeypatch.setattr(builtins, "exec", guarded(real_exec))


def test_no_pair_reaches_sympy_parsing_eval_or_exec(monkeypatch):
    _no_code_paths(monkeypatch)
    for got, want, match in PAIRS:
        assert answers_match(got, want.removeprefix("#### ")) == match, (got, want)


# Short enough for the old character filter and length cap (200): with 315bd21's math reward this
# reply created the file 'pwned' in the working directory.
_PROGRAM = "open('pwned','w')"
HOSTILE = {
    "exec(chr(...))": "\\boxed{exec(" + "+".join(f"chr({ord(c)})" for c in _PROGRAM) + ")}",
    "__import__": "\\boxed{__import__('os').system('touch pwned')}",
    "attribute": "\\boxed{(1).__class__.__bases__}",
    "lambda": "\\boxed{(lambda: open('pwned', 'w'))()}",
    "dunder name": "\\boxed{__builtins__}",
    "open()": "\\boxed{open('pwned','w')}",
    "huge exponent": "\\boxed{2^{99999999}}",
    "huge exponent, plain": "\\boxed{2**99999999}",
    "power tower": "\\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    "symbolic power": "\\boxed{(x+1)^{99999}}",
    "many-variable power": "\\boxed{(a+b+c+d+e+f+g+h+i+j+k+l+m)^{10000}}",
    "huge scientific": "\\boxed{1e99999}",
    "irrational tower": "\\boxed{\\pi^{\\pi^{\\pi^{\\pi^{\\pi}}}}}",
    "20,000 nested braces": "\\boxed{" + "{" * 20_000 + "42" + "}" * 20_000 + "}",
    "20,000 nested parentheses": "\\boxed{" + "(" * 20_000 + "42" + ")" * 20_000 + "}",
    "20,000 minus signs": "\\boxed{" + "-" * 20_000 + "42}",
    "1 MB boxed": "\\boxed{" + "4" * 1_000_000 + "}",
    "1 MB of braces": "\\boxed{" + "{" * 500_000 + "}" * 500_000 + "}",
    "unbalanced braces": "\\boxed{{{{42}",
    "unicode digits": "\\boxed{\u0664\u0662}",
    "fullwidth digits": "\\boxed{\uff14\uff12}",
    "NUL byte": "\\boxed{4\x002}",
    "empty box": "\\boxed{}",
    "only spaces": "\\boxed{   }",
    "division by zero": "\\boxed{42 + 1/0}",
    "zero to a negative power": "\\boxed{0^{-1}}",
    "sqrt index 10^6": "\\boxed{\\sqrt[1000000]{42}}",
    "unknown command": "\\boxed{\\input{/etc/passwd}}",
    "a 101-digit number": "\\boxed{" + "4" * 101 + "}",
    "a 400-term product": "\\boxed{" + "*".join(["99999999999"] * 400) + "}",
}


def test_hostile_answers_score_zero_fast_and_run_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _no_code_paths(monkeypatch)
    for name, reply in HOSTILE.items():
        t0 = time.monotonic()
        assert math_reward(completion=reply, answer="42") == 0.0, name
        assert time.monotonic() - t0 < 1.0, name
    assert list(tmp_path.iterdir()) == []


def test_bounds_refuse_before_computing():
    for text, why in [("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1), "nested"),
                      ("-" * (MAX_DEPTH + 1) + "1", "nested"), ("9^{9999}", "bits"),
                      ("3^{99999999}", "bound"),
                      ("2^{9000} \\cdot 2^{9000} \\cdot 2^{9000} \\cdot 2^{9000}", "bits"),
                      ("x" + "+x" * 600, "characters"), ("\\sqrt[101]{2}", "index"), ("10^{10^{5}}", "bound"),
                      ("\\pi^{20000}", "bound")]:
        with pytest.raises(Unparseable, match=why):
            answers_equal(text, "1")
    # Just inside each bound: MAX_DEPTH brackets, an
    # exponent of exactly MAX_EXPONENT, a value of exactly MAX_BITS (2^32766: 32,767 + 1 bits).
    assert answers_equal("(" * MAX_DEPTH + "7" + ")" * MAX_DEPTH, "7")
    assert answers_equal(f"2^{{{MAX_EXPONENT}}}", f"4^{{{MAX_EXPONENT // 2}}}")
    inside = "2^{10000} \\cdot 2^{10000} \\cdot 2^{10000} \\cdot 2^{%d}"
    assert MAX_BITS == 32_768 and answers_equal(inside % 2766, inside % 2766)
    with pytest.raises(Unparseable, match="bits"):
        answers_equal(inside % 2767, "1")


def _render(node, rng) -> tuple[str, Fraction]:
    """A random expression over small fractions, in LaTeX, with its value computed here."""
    if node == 0:
        v = Fraction(rng.randint(-20, 20), rng.choice([1, 1, 2, 3, 4, 10]))
        text = (f"\\frac{{{v.numerator}}}{{{v.denominator}}}" if v.denominator != 1 else str(v.numerator))
        return f"({text})", v
    (a, va), (b, vb) = _render(node - 1, rng), _render(rng.randint(0, node - 1), rng)
    op = rng.choice(["+", "-", "\\cdot", "/", "^"])
    if op == "/" and vb == 0:
        op = "+"
    if op == "^":
        n = rng.randint(-3, 3)
        if va == 0 and n < 0:
            n = 2
        return f"{{{a}}}^{{{n}}}", va ** n
    value_ = {"+": va + vb, "-": va - vb, "\\cdot": va * vb, "/": va / vb if vb else 0}[op]
    return f"{{{a} {op} {b}}}", value_


def test_values_against_fraction_arithmetic_done_here():
    rng = random.Random(44)
    for _ in range(300):
        text, want = _render(rng.randint(0, 4), rng)
        assert math_values.value(math_answer.parse(text), {}) == want, text
        near = want + Fraction(1, 10**12)
        assert answers_equal(text, str(want.numerator) + "/" + str(want.denominator))
        assert not answers_equal(text, f"{near.numerator}/{near.denominator}")


def test_the_public_pool_scores_rows_and_hostile_replies_without_running_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the worker inherits this cwd: a file written by a reply lands here
    pool = RewardPool("math", workers=1, timeout_s=10)
    try:
        rows = [("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{0.33}", "1/3", 0.0),
                ("#### 1,234", "Natalia...\n#### 1234", 1.0), (HOSTILE["exec(chr(...))"], "42", 0.0),
                (HOSTILE["huge exponent"], "42", 0.0), (HOSTILE["20,000 nested braces"], "42", 0.0)]
        for completion, answer, want in rows:
            t0 = time.monotonic()
            r = pool.score(completion=completion, answer=answer, prompt="", task={})
            assert (r.reward, r.error) == (want, None), (completion[:40], r)
            assert time.monotonic() - t0 < 5
    finally:
        pool.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("got", "want"), [("\\pi^0", "1"), ("0\\sqrt{2}", "0"), ("2^{\\pi^0}", "2"),
                                           ("x^{\\pi^0}", "x"), ("\\sqrt{2}^0 + 1", "2")])
def test_a_value_whose_interval_is_one_point_equals_that_number(got, want):
    """``\\pi^0`` and ``0\\sqrt{2}`` are computed as intervals that are single points ([1, 1],
    [0, 0]); against 1 and 0 both widths are 0. They were unequal: the width tested by an mpmath
    interval's truthiness (always true) took the magnitude of 0 (-inf), and that ValueError
    scored the pair as no answer. Not equal to a neighbour either."""
    assert answers_equal(got, want) and answers_equal(want, got)
    assert not answers_equal(got, f"{want} + 1")


def test_an_exponent_computed_as_an_interval_has_the_exact_exponents_bound():
    """``2^{10000 \\pi^0}``: its exponent is the one-point interval [10000, 10000], at the bound an
    exact exponent may reach (``MAX_EXPONENT``, inclusive): allowed, and equal to 2^{10000}; one more
    is over the bound, as for an exact exponent."""
    assert not answers_equal(f"2^{{{MAX_EXPONENT}\\pi^0}}", "1")
    assert answers_equal(f"2^{{{MAX_EXPONENT}\\pi^0}}", f"2^{{{MAX_EXPONENT}}}")
    for text in (f"2^{{{MAX_EXPONENT + 1}\\pi^0}}", f"2^{{{MAX_EXPONENT + 1}}}"):
        with pytest.raises(Unparseable, match="an exponent over the bound"):
            answers_equal(text, "1")


@pytest.mark.parametrize(("got", "want"), [
    ("\\pi + 10^{-40}", "\\pi"),  # 40 digits past the point: inside the 20 spare digits' reach
    ("(\\sqrt{2}+1)^{200} - (\\sqrt{2}-1)^{-200} + 10^{-30}", "0"),  # 10^76 - 10^76: a cancellation
    # 10^24 - 10^24 + 10^-40: the precision grew by the value's digits alone (1) and the intervals,
    # 10^-38 wide, met: equal, 3 digits short of the 10^-(33 + 10) it is judged by
    ("(\\sqrt{2}+1)^{64} - (\\sqrt{2}-1)^{-64} + 10^{-40}", "0"),
])
def test_a_near_miss_far_past_the_digits_written_is_still_a_miss(got, want):
    """Two values that differ are never equal, whatever digits the answers hold: the comparison
    runs 20 digits past those (``\\pi + 10^{-40}`` holds 4) and, where a difference of huge values
    cancels, that many past the cancellation too. Without the 20, or without the digits in the
    cancellation's precision, both read equal."""
    assert not answers_equal(got, want) and not answers_equal(want, got)
