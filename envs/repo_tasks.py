"""Small Python packages with planted bugs, generated from a seed, for the ``repo`` environment.

A task is a package ``<pkg>/`` of two or three modules of short functions and a ``tests/``
directory of plain ``assert`` lines (the format the hardened ``code`` harness parses,
``envs.rewards.code_harness.parse_tests``). ``difficulty`` functions carry one bug each, of one
of four kinds: an off-by-one, a wrong operator, a missing branch, a wrong default. Every bug is a
snippet of the correct source replaced by a buggy one (unique in its module), so the fix is one
string replacement, which the scripted demonstration makes. Expected values are computed here by
running the *correct* functions (our own code, never the model's); the tests keep every
function's asserts and at least one that the bug fails.
"""

from __future__ import annotations

import dataclasses

import numpy as np

BUG_KINDS = ("off_by_one", "wrong_operator", "missing_branch", "wrong_default")


@dataclasses.dataclass(frozen=True)
class Template:
    """A function: its source (``{name}``, ``{k}`` filled in), bugs as ``kind -> (correct
    snippet, buggy snippet)``, and argument tuples to test it on (``rng -> [args]``)."""

    names: tuple[str, ...]
    source: str
    bugs: dict[str, tuple[str, str]]
    inputs: object  # Callable[[np.random.Generator, int], list[tuple]]


def _ints(rng: np.random.Generator, n: int, lo: int = -9, hi: int = 20) -> list[int]:
    return [int(x) for x in rng.integers(lo, hi, n)]


TEMPLATES = (
    Template(("clamp", "bound", "limit"), '''def {name}(value, low, high):
    """Limit value to the closed range [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value
''', {"wrong_operator": ("    if value < low:\n", "    if value > low:\n"),
     "missing_branch": ("        return low\n    if value > high:\n        return high\n",
                        "        return low\n")},
        lambda rng, k: [(v, 0, 10) for v in (-3, 4, 15, *_ints(rng, 2))]),
    Template(("total", "add_all", "running_sum"), '''def {name}(values, start=0):
    """Add up values, beginning from start."""
    result = start
    for v in values:
        result += v
    return result
''', {"wrong_default": ("start=0)", "start=1)"), "wrong_operator": ("result += v", "result -= v")},
        lambda rng, k: [(_ints(rng, 3),), (_ints(rng, 4),), ([],)]),
    Template(("last_items", "tail", "newest"), '''def {name}(items, n):
    """The last n items of a list, oldest first."""
    if n <= 0:
        return []
    return items[len(items) - n:]
''', {"off_by_one": ("items[len(items) - n:]", "items[len(items) - n + 1:]")},
        lambda rng, k: [(_ints(rng, 5), 2), (_ints(rng, 4), 1), (_ints(rng, 3), 0)]),
    Template(("count_between", "span_size", "inclusive_count"), '''def {name}(low, high):
    """How many integers lie in [low, high], both ends included."""
    if high < low:
        return 0
    return high - low + 1
''', {"off_by_one": ("high - low + 1", "high - low"),
     "missing_branch": ('included."""\n    if high < low:\n        return 0\n', 'included."""\n')},
        lambda rng, k: [(1, 5), (3, 3), (7, 2), (int(rng.integers(0, 9)), int(rng.integers(10, 30)))]),
    Template(("sign", "direction", "polarity"), '''def {name}(x):
    """-1, 0 or 1: the sign of x."""
    if x > 0:
        return 1
    if x < 0:
        return -1
    return 0
''', {"missing_branch": ("        return 1\n    if x < 0:\n        return -1\n", "        return 1\n"),
     "wrong_operator": ("if x > 0:", "if x >= 0:")},
        lambda rng, k: [(5,), (-2,), (0,), (int(rng.integers(-50, 50)),)]),
    Template(("scale", "times", "multiply"), '''def {name}(x, factor={k}):
    """x multiplied by factor ({k} unless given)."""
    return x * factor
''', {"wrong_default": ("factor={k})", "factor={k1})"), "wrong_operator": ("x * factor", "x + factor")},
        lambda rng, k: [(int(rng.integers(2, 9)),), (3, 4), (int(rng.integers(2, 20)),)]),
    Template(("find_index", "position", "index_of"), '''def {name}(items, target):
    """Index of the first item equal to target, or -1."""
    for i in range(len(items)):
        if items[i] == target:
            return i
    return -1
''', {"off_by_one": ("range(len(items))", "range(1, len(items))"),
     "wrong_operator": ("items[i] == target", "items[i] != target")},
        lambda rng, k: [([4, 7, 9], 4), ([1, 2, 3], 3), ([5, 6], 8)]),
    Template(("count_above", "how_many_over", "exceeding"), '''def {name}(values, threshold):
    """How many values are strictly greater than threshold."""
    count = 0
    for v in values:
        if v > threshold:
            count += 1
    return count
''', {"wrong_operator": ("v > threshold", "v >= threshold"), "off_by_one": ("count = 0", "count = 1")},
        lambda rng, k: [([1, 5, 5, 8], 5), (_ints(rng, 5), 3), ([], 0)]),
    Template(("join_words", "glue", "joined"), '''def {name}(words, sep="{sep}"):
    """The words joined by sep."""
    return sep.join(words)
''', {"wrong_default": ('sep="{sep}")', 'sep="{sep2}")')},
        lambda rng, k: [(["a", "b", "c"],), (["x"],), (["to", "do"], "+")]),
    Template(("is_even", "even", "divisible_by_two"), '''def {name}(n):
    """True when n is even."""
    return n % 2 == 0
''', {"wrong_operator": ("n % 2 == 0", "n % 2 != 0")},
        lambda rng, k: [(4,), (7,), (0,), (int(rng.integers(0, 99)),)]),
)

PACKAGES = ("toolkit", "numkit", "listops", "helpers", "mathbits", "utilbox", "calc", "pyaux")
MODULES = ("core", "numbers", "lists", "text", "ranges", "checks")


@dataclasses.dataclass(frozen=True)
class Bug:
    path: str
    kind: str
    function: str
    correct: str  # the snippet the fix restores
    buggy: str  # the snippet in the task's source (unique in its file)


def _render(t: Template, name: str, k: int, sep: str, sep2: str) -> tuple[str, dict[str, tuple[str, str]]]:
    fill = dict(name=name, k=k, k1=k + 1, sep=sep, sep2=sep2)
    bugs = {kind: (a.format(**fill), b.format(**fill)) for kind, (a, b) in t.bugs.items()}
    return t.source.format(**fill), bugs


def _calls(ns: dict, name: str, args_list: list[tuple]) -> list[tuple[str, object]]:
    out = []
    for args in args_list:
        call = f"{name}({', '.join(repr(a) for a in args)})"
        out.append((call, eval(call, dict(ns))))  # noqa: S307 - our own generated, correct code
    return out


def generate(rng: np.random.Generator, difficulty: int = 1) -> dict:
    """``_generate`` until its draw plants only bugs the tests catch, each unique in its file
    (a few draws at most: most templates' snippets are unique in any module)."""
    for _ in range(50):
        try:
            return _generate(rng, difficulty)
        except _Redraw:
            continue
    raise RuntimeError("repo task: 50 draws without a valid task")


class _Redraw(Exception):
    pass


def _generate(rng: np.random.Generator, difficulty: int) -> dict:
    """A task payload: ``package``, ``files`` (path -> text, what the episode starts from),
    ``sources`` (the package's module paths, what grading reads back), ``tests`` (test path ->
    text) and ``bugs`` (what was planted, for the demonstration and the logs)."""
    pkg = str(rng.choice(PACKAGES))
    n_modules = 2 + int(rng.integers(0, 2))
    modules = [str(m) for m in rng.choice(MODULES, n_modules, replace=False)]
    order = [int(i) for i in rng.permutation(len(TEMPLATES))]
    per_module = len(order) // n_modules
    buggy_count = min(max(1, difficulty), n_modules * 2)
    # Which functions get a bug: spread over modules, only templates that have one.
    files, sources, tests, bugs = {f"{pkg}/__init__.py": f'"""The {pkg} package."""\n'}, [], {}, []
    slots = [(m, order[i * per_module: (i + 1) * per_module]) for i, m in enumerate(modules)]
    flat = [(m, t) for m, ts in slots for t in ts]
    bugged = {int(i) for i in rng.choice(len(flat), buggy_count, replace=False)}
    for m, template_ids in slots:
        path = f"{pkg}/{m}.py"
        correct_parts, buggy_parts, imports, asserts, planted = [], [], [], [], []
        for t_index in template_ids:
            t = TEMPLATES[t_index]
            name = str(rng.choice(t.names))
            k = int(rng.integers(2, 9))
            sep, sep2 = [str(s) for s in rng.choice([",", "-", " ", ";", "/"], 2, replace=False)]
            source, variants = _render(t, name, k, sep, sep2)
            correct_parts.append(source)
            pos = flat.index((m, t_index))
            if pos in bugged:
                kind = str(rng.choice(sorted(variants)))
                good, bad = variants[kind]
                buggy_parts.append(source.replace(good, bad, 1))
                planted.append((name, kind, good, bad, t))
            else:
                buggy_parts.append(source)
            imports.append(name)
            asserts.append((t, name, k))
        header = f'"""{m.capitalize()} helpers of {pkg}."""\n\n\n'
        correct_src = header + "\n\n".join(correct_parts)
        buggy_src = header + "\n\n".join(buggy_parts)
        good_ns: dict = {}
        exec(compile(correct_src, path, "exec"), good_ns)  # noqa: S102 - our own generated code
        bad_ns: dict = {}
        exec(compile(buggy_src, path, "exec"), bad_ns)  # noqa: S102
        lines = [f"from {pkg}.{m} import {', '.join(imports)}", ""]
        for t, name, k in asserts:
            for call, want in _calls(good_ns, name, t.inputs(rng, k)):
                lines.append(f"assert {call} == {want!r}")
        for name, kind, good, bad, _t in planted:
            failing = [line for line in lines if line.startswith(f"assert {name}(")
                       and not _holds(line, bad_ns)]
            if not failing or buggy_src.count(bad) != 1:
                raise _Redraw(f"the {kind} bug in {name} is not caught or not unique")
            bugs.append(Bug(path, kind, name, good, bad))
        files[path] = buggy_src
        sources.append(path)
        test_path = f"tests/test_{m}.py"
        tests[test_path] = "\n".join(lines) + "\n"
        files[test_path] = tests[test_path]
    return {"package": pkg, "files": files, "sources": [f"{pkg}/__init__.py", *sources], "tests": tests,
            "bugs": [dataclasses.asdict(b) for b in bugs]}


def _holds(line: str, ns: dict) -> bool:
    try:
        exec(line, dict(ns))  # noqa: S102 - our own generated asserts on our own buggy code
        return True
    except Exception:  # noqa: BLE001 - the bug raised: the test fails
        return False


__all__ = ["BUG_KINDS", "TEMPLATES", "Bug", "generate"]
