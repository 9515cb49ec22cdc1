"""The ``math`` reward's answers: read by a grammar of our own into values, never run as code.

A reply's final answer is model output, so it is parsed, not evaluated: a tokenizer that knows
numbers (``12``, ``-3.5``, ``1,234,567``, ``6.02e23``), single-letter symbols, ``+ - * / ^ **``,
brackets, ``\\frac`` (``\\dfrac``, ``\\tfrac``, ``\\frac12``), ``\\sqrt{}`` / ``\\sqrt[n]{}`` /
``sqrt()``, ``\\pi``, ``\\cdot`` / ``\\times`` / ``\\div``, and a recursive-descent parser that
builds a tree of those and nothing else. Anything outside that alphabet or grammar raises
``Unparseable``: no ``eval``, ``exec``, ``sympify`` or ``parse_expr`` ever sees the text, and
there are no names, attributes or calls beyond the ones listed. Everything is bounded: the text
(``MAX_CHARS``), the nesting (``MAX_DEPTH``, counted, so no ``RecursionError``), the digits of a
number (``MAX_DIGITS``), the size of every exact intermediate value (``MAX_BITS``: ``2^99999999``
is refused before it is computed) and the exponent of an inexact power (``MAX_EXPONENT``).

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
equals ``\\pi^{100}``. A division by what may be 0 (``1/(\\sqrt{2}-\\sqrt{2})``) is no value, and so is a
fractional power of a negative number unless the root is odd (``\\sqrt[3]{-8}`` is -2).

Forms read as the answer, not as part of it (``normalise``): ``$`` and ``\\$``, ``\\left`` /
``\\right``, spacing commands, ``\\text{}`` / ``\\mathrm{}`` wrappers, a trailing period, a
leading ``x =``, and trailing unit words of two letters or more (``12 dollars``, ``5 cm^2``,
``60 km/h``). A percent sign is a unit too: ``50\\%`` equals ``50``, not ``0.5`` (GSM8K and MATH
state percentages as the number of percent). A number directly followed by ``\\frac``
(``3\\frac{1}{2}``: a mixed number or a product?) is ambiguous and refused.
"""

from __future__ import annotations

import re
import secrets
from fractions import Fraction

MAX_CHARS = 1000
MAX_DEPTH = 40
MAX_DIGITS = 100
MAX_BITS = 32_768
MAX_EXPONENT = 10_000
MAX_ROOT = 100
MAX_MAGNITUDE = 10_000  # decimal digits before the point of an inexact value that is compared
MAX_POWERS = 32  # powers and roots in one answer: each inexact one costs a log and an exp at full precision
_DRAWS = 2

Value = Fraction | object  # an exact Fraction, or an mpmath interval (mpmath.iv) enclosing the value


class Unparseable(ValueError):
    """The text is not an answer this grammar reads (or is over one of its bounds)."""


# ---------------------------------------------------------------- text to tokens

_UNICODE = {"\u2212": "-", "\u00d7": "\\times ", "\u00f7": "/", "\u03c0": "\\pi ", "\u00b7": "\\cdot ",
            "\u22c5": "\\cdot ", "\u00b0": " degrees", "\u2009": " ", "\u202f": " ", "\u00a0": " "}
_WRAPPERS = re.compile(r"\\(?:text|textrm|textbf|textit|mathrm|mathbf|mathit|mbox|operatorname)"
                       r"\s*\{([^{}]*)\}")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree")
_FRAC_SHORT = re.compile(r"\\frac\s*([0-9A-Za-z])\s*([0-9A-Za-z])")
_SQRT_SHORT = re.compile(r"\\sqrt\s*([0-9A-Za-z])")
_TOKEN = re.compile(r"""
    (?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d|,\d)     # 1,234,567.5
          |(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)        # 12, 3.5, .5, 6.02e23
  | (?P<cmd>\\[A-Za-z]+)
  | (?P<word>[A-Za-z]+)
  | (?P<op>\*\*|[-+*/^()\[\]{}=])
  | (?P<space>\s+)
""", re.VERBOSE | re.ASCII)
_COMMANDS = {"\\frac": "frac", "\\sqrt": "sqrt", "\\pi": "pi", "\\cdot": "*", "\\times": "*", "\\div": "/"}
_FUNCTIONS = {"sqrt": "sqrt", "pi": "pi"}


def normalise(text: str) -> str:
    """The answer with its wrappers, spacing and currency marks removed; ``Unparseable`` for text
    over ``MAX_CHARS`` or with a character outside printable ASCII (after a few common symbols
    are mapped: unicode minus, times, pi, degrees)."""
    if len(text) > MAX_CHARS:
        raise Unparseable(f"over {MAX_CHARS} characters")
    text = "".join(_UNICODE.get(c, c) for c in text)
    if not all(" " <= c <= "~" or c in "\t\n" for c in text):
        raise Unparseable("a character outside the answer alphabet")
    for junk in ("\\$", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "\\displaystyle"):
        text = text.replace(junk, " " if junk in ("\\;", "\\:", "\\ ") else "")
    text = text.replace("{,}", ",").replace("\\%", " percent ").replace("%", " percent ")
    text = _DEGREES.sub(" degrees ", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(MAX_DEPTH):  # innermost wrapper first; bounded (MAX_DEPTH rounds)
        text, n = _WRAPPERS.subn(r" \1 ", text)
        if not n:
            break
    text = _SQRT_SHORT.sub(r"\\sqrt{\1}", _FRAC_SHORT.sub(r"\\frac{\1}{\2}", text))
    return text.strip().rstrip(".").strip()


def tokens(text: str) -> list[tuple[str, str]]:
    """``(kind, text)`` pairs: num, sym (one letter), word (two or more), frac, sqrt, pi and the
    operators; ``Unparseable`` at the first character no token starts with."""
    out, i = [], 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            raise Unparseable(f"unexpected {text[i]!r}")
        i = m.end()
        kind, value = m.lastgroup, m.group()
        if kind == "space":
            continue
        if kind == "cmd":
            if value not in _COMMANDS:
                raise Unparseable(f"the command {value[:20]!r}")
            name = _COMMANDS[value]
            out.append((name, name) if name in ("frac", "sqrt", "pi") else ("op", name))
        elif kind == "word":
            kind = _FUNCTIONS.get(value, "sym" if len(value) == 1 else "word")
            out.append((kind, value))
        else:
            out.append((kind, "^" if value == "**" else value))
    return _strip_units(_strip_lhs(out))


def _strip_lhs(toks: list) -> list:
    """``x = 5`` is the answer 5."""
    if len(toks) > 2 and toks[0][0] == "sym" and toks[1] == ("op", "="):
        return toks[2:]
    return toks


def _strip_units(toks: list) -> list:
    """Drop a trailing unit phrase: from the first word of two letters or more, only words,
    single letters, ``/`` and ``^ <number>`` may follow (``5 cm^2``, ``60 km/h``)."""
    first = next((i for i, (k, _) in enumerate(toks) if k == "word"), None)
    if first is None:
        return toks
    tail = toks[first:]
    for j, (k, v) in enumerate(tail):
        after_caret = j > 0 and tail[j - 1] == ("op", "^")
        if not (k in ("word", "sym") or (k, v) in (("op", "/"), ("op", "^")) or (k == "num" and after_caret)):
            raise Unparseable(f"the word {toks[first][1][:20]!r} is not a trailing unit")
    if not toks[:first]:
        raise Unparseable("only words")
    return toks[:first]


# ---------------------------------------------------------------- tokens to a tree

class _Parser:
    """Recursive descent over the tokens; every descent counts against ``MAX_DEPTH``.

    Trees: ``("num", Fraction)``, ``("sym", name)``, ``("pi",)``, ``("sum", [(sign, node)])``,
    ``("prod", [(op, node)])`` with op ``*`` or ``/``, ``("neg", node)``, ``("pow", base, exp)``,
    ``("root", node, index)``; sums and products are flat, so a long one is not a deep tree."""

    def __init__(self, toks: list[tuple[str, str]]):
        self.toks, self.i, self.depth, self.powers = toks, 0, 0, 0

    def counted(self, node: tuple) -> tuple:
        self.powers += 1
        if self.powers > MAX_POWERS:
            raise Unparseable(f"over {MAX_POWERS} powers and roots")
        return node

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, want: tuple[str, str] | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise Unparseable(f"expected {want[1] if want else 'more'}, found {tok[1] if tok else 'the end'}")
        self.i += 1
        return tok

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Unparseable(f"nested over {MAX_DEPTH} deep")

    def whole(self) -> tuple:
        if not self.toks:
            raise Unparseable("empty")
        node = self.expr()
        if self.peek() is not None:
            raise Unparseable(f"unexpected {self.peek()[1][:20]!r}")
        return node

    def expr(self) -> tuple:
        terms = [("+", self.term())]
        while self.peek() in (("op", "+"), ("op", "-")):
            terms.append((self.take()[1], self.term()))
        return terms[0][1] if len(terms) == 1 else ("sum", terms)

    def term(self) -> tuple:
        factors = [("*", self.unary())]
        while True:
            tok = self.peek()
            if tok in (("op", "*"), ("op", "/")):
                self.take()
                factors.append((tok[1], self.unary()))
            elif tok is not None and (tok[0] in ("sym", "pi", "sqrt") or tok == ("op", "(")):
                factors.append(("*", self.power()))  # 2x, 3\pi, 2\sqrt{3}, (x+1)(x-1)
            elif tok is not None and tok[0] in ("num", "frac"):
                raise Unparseable(f"{tok[1]!r} right after a factor (a mixed number or a product?)")
            else:
                return factors[0][1] if len(factors) == 1 else ("prod", factors)

    def unary(self) -> tuple:
        if self.peek() in (("op", "-"), ("op", "+")):
            sign = self.take()[1]
            self.enter()
            node = self.unary()
            self.depth -= 1
            return ("neg", node) if sign == "-" else node
        return self.power()

    def power(self) -> tuple:
        base = self.atom()
        if self.peek() != ("op", "^"):
            return base
        self.take()
        self.enter()
        exponent = self.unary()  # right-associative: 2^3^2 is 2^9; 2^-1 is allowed
        self.depth -= 1
        return self.counted(("pow", base, exponent))

    def group(self, close: str) -> tuple:
        self.enter()
        node = self.expr()
        self.take(("op", close))
        self.depth -= 1
        return node

    def atom(self) -> tuple:
        kind, text = self.take()
        if kind == "num":
            return ("num", _number(text))
        if kind == "sym":
            return ("sym", text)
        if kind == "pi":
            return ("pi",)
        if (kind, text) in (("op", "("), ("op", "{"), ("op", "[")):
            return self.group({"(": ")", "{": "}", "[": "]"}[text])
        if kind == "frac":
            self.take(("op", "{"))
            top = self.group("}")
            self.take(("op", "{"))
            return ("prod", [("*", top), ("/", self.group("}"))])
        if kind == "sqrt":
            index = ("num", Fraction(2))
            if self.peek() == ("op", "["):
                self.take()
                index = self.group("]")
            if text == "sqrt" and self.peek() == ("op", "("):  # sqrt(2), as plain text writes it
                self.take()
                return self.counted(("root", self.group(")"), index))
            self.take(("op", "{"))
            return self.counted(("root", self.group("}"), index))
        raise Unparseable(f"unexpected {text[:20]!r}")


def _number(text: str) -> Fraction:
    mantissa, _, exponent = text.replace(",", "").lower().partition("e")
    digits = mantissa.replace(".", "")
    if len(digits) > MAX_DIGITS or len(exponent) > 5:
        raise Unparseable(f"a number of over {MAX_DIGITS} digits")
    whole, _, decimals = mantissa.partition(".")
    value = Fraction(int(whole or "0") * 10 ** len(decimals) + int(decimals or "0"), 10 ** len(decimals))
    if exponent:
        e = int(exponent)
        if abs(e) * 3.33 > MAX_BITS:
            raise Unparseable(f"the exponent of {text[:20]!r}")
        value *= Fraction(10) ** e
    return value


def parse(text: str) -> tuple:
    """The tree of an answer (``normalise`` d first); ``Unparseable`` for anything else."""
    return _Parser(tokens(normalise(text))).whole()


# ---------------------------------------------------------------- a tree to a value


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
            need = max(int(iv.mag(size) * 0.302) + 1, int(iv.mag(width) * 0.302) + digits + 1 if width else 0)
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


__all__ = ["MAX_BITS", "MAX_CHARS", "MAX_DEPTH", "MAX_MAGNITUDE", "MAX_POWERS", "Unparseable",
           "answers_equal", "normalise", "parse", "tokens", "value"]
