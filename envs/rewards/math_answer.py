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
is refused before it is computed) and the exponent of an inexact power
(``math_values.MAX_EXPONENT``).

The values of a tree, and whether two answers are equal, are ``envs.rewards.math_values``'.

Forms read as the answer, not as part of it (``normalise``): ``$`` and ``\\$``, ``\\left`` /
``\\right``, spacing commands, ``\\text{}`` / ``\\mathrm{}`` wrappers, a trailing period, a
leading ``x =``, and trailing unit words of two letters or more (``12 dollars``, ``5 cm^2``,
``60 km/h``). A percent sign is a unit too: ``50\\%`` equals ``50``, not ``0.5`` (GSM8K and MATH
state percentages as the number of percent). A number directly followed by ``\\frac``
(``3\\frac{1}{2}``: a mixed number or a product?) is ambiguous and refused.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_CHARS = 1000
MAX_DEPTH = 40
MAX_DIGITS = 100
MAX_BITS = 32_768
MAX_POWERS = 32  # powers and roots in one answer: each inexact one costs a log and an exp at full precision

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


__all__ = ["MAX_BITS", "MAX_CHARS", "MAX_DEPTH", "MAX_DIGITS", "MAX_POWERS", "Unparseable", "normalise",
           "parse", "tokens"]
