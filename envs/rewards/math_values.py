"""The values of the ``math`` reward's answers (trees from ``envs.rewards.math_answer.parse``) and
whether two answers are equal.

Values are exact where they can be: numbers are ``Fraction`` s (``0.33`` is 33/100, never 1/3).
Symbols are given the same random integers on both sides (two draws), so ``x^2+2x+1`` equals
``(x+1)^2`` by exact arithmetic (a polynomial identity that holds at random points holds; a wrong
one does so with probability about degree / 2^32). Irrational parts (``\\sqrt{2}``, ``\\pi``,
``8^{1/2}``) are computed as intervals (``mpmath.iv``) that certainly hold the value: two answers
differ when their intervals are apart, and are equal when they meet with widths below 10^-10
past the digits the two answers hold together plus 20 (the precision grows with the values'
magnitude and with any cancellation, up to ``MAX_MAGNITUDE`` digits). So ``2\\sqrt{2}`` equals
``\\sqrt{8}`` and ``(\\sqrt{2}+1)^{64} - (\\sqrt{2}-1)^{-64}`` equals 0, while a decimal written to
any number of digits never equals the irrational it approximates, nor ``\\pi^{100} + 1``
equals ``\\pi^{100}``. A division by what may be 0 (``1/(\\sqrt{2}-\\sqrt{2})``) is no value, and
so is a fractional power of a negative number unless the root is odd (``\\sqrt[3]{-8}`` is -2).
"""

from __future__ import annotations

import secrets
from fractions import Fraction

from envs.rewards.math_answer import MAX_BITS, Unparseable, parse

MAX_EXPONENT = 10_000
MAX_ROOT = 100
MAX_MAGNITUDE = 10_000  # decimal digits before the point of an inexact value that is compared
_DRAWS = 2

Value = Fraction | object  # an exact Fraction, or an mpmath interval (mpmath.iv) enclosing the value


def _bits(v: Fraction) -> int:
    return v.numerator.bit_length() + v.denominator.bit_length()


def _exact(v: Fraction) -> Fraction:
    if _bits(v) > MAX_BITS:
        raise Unparseable(f"an exact value over {MAX_BITS} bits")
    return v


def _iroot(n: int, k: int) -> int | None:
    """The integer k-th root of n >= 0 if n is a perfect k-th power, else None."""
    lo, hi = 0, 1 << (n.bit_length() // k + 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid ** k <= n:
            lo = mid
        else:
            hi = mid - 1
    return lo if lo ** k == n else None


def _iv():
    from mpmath import iv  # interval arithmetic: every inexact value carries its error bounds

    return iv


def _inexact(v: Value):
    """``v`` as an mpmath interval at the current precision (a fraction's bounds enclose it)."""
    return _iv().mpf(v.numerator) / v.denominator if isinstance(v, Fraction) else v


def _real(v):
    """``v`` if it is a real interval with finite bounds; ``Unparseable`` for a complex one
    (``(-8)^{1/3}``) or one without bounds."""
    from mpmath.libmp import finf, fnan, fninf

    if not isinstance(v, _iv().mpf) or any(end in (finf, fninf, fnan) for end in v._mpi_):
        raise Unparseable("not a finite real number")
    return v


def _may_be_zero(v: Value) -> bool:
    return v == 0 if isinstance(v, Fraction) else bool(v.a <= 0 <= v.b)


def _power(base: Value, exp: Value) -> Value:
    if isinstance(exp, Fraction):
        if abs(exp.numerator) > MAX_EXPONENT or exp.denominator > MAX_ROOT:
            raise Unparseable("an exponent over the bound")
        if isinstance(base, Fraction):
            if base == 0 and exp < 0:
                raise ZeroDivisionError("0 to a negative power")
            if exp.denominator == 1 or base >= 0:
                size = max(base.numerator.bit_length(), base.denominator.bit_length())
                if size * abs(exp.numerator) > MAX_BITS:
                    raise Unparseable(f"a power over {MAX_BITS} bits")
                if exp.denominator == 1:
                    return _exact(base ** exp.numerator)
                k = exp.denominator
                top, bottom = _iroot(base.numerator, k), _iroot(base.denominator, k)
                if top is not None and bottom is not None:
                    return _exact(Fraction(top, bottom) ** exp.numerator)
        if exp.denominator % 2 and (base < 0 if isinstance(base, Fraction) else base.b < 0):
            odd = -1 if exp.numerator % 2 else 1  # an odd root of a negative number is real: (-8)^(1/3) = -2
            return odd * _power(-base, exp)
        if exp.denominator == 1:  # an interval to a whole power: exact rules, its sign kept
            if exp < 0 and _may_be_zero(base):
                raise ZeroDivisionError("0 to a negative power")
            return _real(_inexact(base) ** exp.numerator)
    elif max(abs(exp.a), abs(exp.b)) > MAX_EXPONENT:
        raise Unparseable("an exponent over the bound")
    base = _inexact(base)
    if base.a < 0:  # a root or a real power of a negative number is not a real number
        raise Unparseable("a fractional power of a negative number")
    if _may_be_zero(base):
        raise ZeroDivisionError("a fractional power of a number that may be 0")
    return _real(_iv().power(base, _inexact(exp)))  # mpmath's exponents are unbounded ints


def value(node: tuple, env: dict[str, Fraction]) -> Value:
    """The value of a tree with the symbols' values in ``env``: an exact Fraction, or an mpmath
    interval enclosing it; ZeroDivisionError for a division by (what may be) zero, ``Unparseable``
    past a bound. The intervals' precision is the caller's (``answers_equal``)."""
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "sym":
        return env[node[1]]
    if kind == "pi":
        return _iv().pi * 1
    if kind == "neg":
        return -value(node[1], env)
    if kind == "sum":
        total: Value = Fraction(0)
        for sign, term in node[1]:
            v = value(term, env)
            if isinstance(total, Fraction) and isinstance(v, Fraction):
                total = _exact(total + v if sign == "+" else total - v)
            else:
                total = _real(_inexact(total) + _inexact(v) if sign == "+" else _inexact(total) - _inexact(v))
        return total
    if kind == "prod":
        product: Value = Fraction(1)
        for op, factor in node[1]:
            v = value(factor, env)
            if op == "/" and _may_be_zero(v):
                raise ZeroDivisionError("division by (what may be) zero")
            if isinstance(product, Fraction) and isinstance(v, Fraction):
                product = _exact(product * v if op == "*" else product / v)
            else:
                a, b = _inexact(product), _inexact(v)
                product = _real(a * b if op == "*" else a / b)
        return product
    if kind == "pow":
        return _power(value(node[1], env), value(node[2], env))
    if kind == "root":
        index = value(node[2], env)
        if not isinstance(index, Fraction) or index.denominator != 1 or not 1 <= index <= MAX_ROOT:
            raise Unparseable("a root's index must be a whole number from 1 to 100")
        return _power(value(node[1], env), 1 / index)
    raise ValueError(f"unknown node {kind!r}")


def _symbols(node: tuple, found: set[str]) -> set[str]:
    stack = [node]
    while stack:  # iterative: a tree is at most MAX_DEPTH deep, but no recursion is needed here
        n = stack.pop()
        if n[0] == "sym":
            found.add(n[1])
        elif n[0] in ("sum", "prod"):
            stack += [child for _, child in n[1]]
        elif n[0] in ("neg", "pow", "root"):
            stack += [c for c in n[1:] if isinstance(c, tuple)]
    return found


def _equal_at(a: tuple, b: tuple, env: dict[str, Fraction], digits: int) -> bool:
    """Whether the two trees have one value at ``env``: exactly for fractions; else their
    intervals, computed to ``digits`` digits past the point (more for large values, so
    ``\\pi^{100} + 1`` is not ``\\pi^{100}``, and where a cancellation widened them), must meet.
    Values over ``MAX_MAGNITUDE`` digits, or that need more precision than that, are refused."""
    iv = _iv()
    saved, extra = iv.dps, 0
    try:
        for _ in range(4):
            iv.dps = digits + extra + 30
            va, vb = value(a, env), value(b, env)
            if isinstance(va, Fraction) and isinstance(vb, Fraction):
                return va == vb
            va, vb = _inexact(va), _inexact(vb)
            if va.b < vb.a or vb.b < va.a:
                return False  # disjoint: different for certain
            size = max(abs(va.a), abs(va.b), abs(vb.a), abs(vb.b), iv.mpf(1)).b
            width = max(va.delta.b, vb.delta.b)
            # The digits to add: the value's own, and those that bring the width down to the
            # 10^-(digits + 10) it is judged by (a cancellation of huge values leaves a wide one).
            # `> 0`, not truthiness: an mpmath interval is always true, and a width of exactly 0
            # (two one-point intervals: \pi^0 and 1) has no magnitude (mag(0) = -inf).
            need = max(int(iv.mag(size) * 0.302) + 1,
                       int(iv.mag(width) * 0.302) + digits + 11 if width > 0 else 0)
            if need > MAX_MAGNITUDE:
                raise Unparseable(f"a value or a cancellation of over {MAX_MAGNITUDE} digits")
            if need <= extra or width <= iv.mpf(10) ** -(digits + 10):
                return True  # they meet, to digits + 10 digits past the point
            extra = need
        raise Unparseable("no precision settles the comparison")
    finally:
        iv.dps = saved


def answers_equal(got: str, want: str) -> bool:
    """Whether two answers are the same value (see the module docstring); ``Unparseable`` if
    either is not an answer."""
    a, b = parse(got), parse(want)
    names = sorted(_symbols(a, set()) | _symbols(b, set()))
    # A decimal near-miss of an irrational differs from it at about the digits the answers hold:
    # compare to 20 digits past those.
    digits = 20 + sum(c.isdigit() for c in got + want)
    for _ in range(_DRAWS if names else 1):
        env = {n: Fraction(secrets.randbits(32) | 1 << 31) for n in names}
        try:
            if not _equal_at(a, b, env, digits):
                return False
        except (ZeroDivisionError, OverflowError, ValueError) as e:
            if isinstance(e, Unparseable):
                raise
            return False  # undefined (1/0) on either side: not an answer to compare
    return True


__all__ = ["MAX_EXPONENT", "MAX_MAGNITUDE", "MAX_ROOT", "answers_equal", "value"]
