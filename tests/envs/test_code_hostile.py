"""The ``code`` reward: nothing that compares with an expected value runs in the jail (issue 44 item 2;
issue 46's ``assert f() is True`` survivor).

Every bypass the issue lists scored 1.0 against a wrong reply (an always-equal object, or
``builtins.all`` / ``math.isclose`` patched) while the harness fell back to the truth of the whole
expression evaluated in the jail: with the harness of 315bd21, 20 of the 24 assert lines below
scored 1.0 against ``GAMER`` (the walrus, numpy, the ``and`` and the chained comparison did not).
Each is now an ``unsupported_test`` reward error, found when the row's tests are read (before any
sandbox starts). Values that are not plain data are
``non_plain_value``; truth checks pass only a plain bool from the reply's own call; every
documented form still passes a right solution and fails a wrong one, in the real sandbox."""

from __future__ import annotations

import pytest

from envs.rewards import RewardPool
from envs.rewards.builtin import code_reward
from envs.rewards.code_harness import Case, passes
from envs.rewards.code_tests import parse_tests
from envs.rewards.errors import RewardError
from envs.sandbox import sandbox_available

needs_sandbox = pytest.mark.skipif(not sandbox_available(), reason="needs root + unshare (namespaces)")

# A wrong reply that games every in-jail comparison it can reach.
GAMER = """
import builtins, math, operator
_isinstance = builtins.isinstance
class Yes:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __bool__(self): return True
    def __lt__(self, other): return True
    def __gt__(self, other): return True
    def __hash__(self): return 0
def add(a, b):
    return Yes()
builtins.all = builtins.any = lambda *a, **k: True
builtins.isinstance = lambda o, t: True if type(o) is Yes else _isinstance(o, t)  # json still works
math.isclose = lambda *a, **k: True
operator.eq = lambda *a, **k: True
"""
ALWAYS_EQUAL = "class Yes:\n    def __eq__(self, o): return True\ndef add(a, b): return Yes()\n"
# (tests, what the issue or we call it)
BYPASSES = [
    ("assert add(2, 3) == 5 or add(2, 3) == 6", "or"),
    ("assert (add(2, 3) == 5) == True", "== True around a comparison"),
    ("assert not add(2, 3) != 5", "not around a comparison"),
    ("assert (add(2, 3) == 5) is True", "is True around a comparison"),
    ("assert bool(add(2, 3) == 5)", "bool of a comparison"),
    ("assert bool(add(2, 3))", "bool of the reply's value"),
    ("assert True if add(2, 3) == 5 else False", "conditional expression"),
    ("assert all(add(a, b) == a + b for a, b in [(1, 2), (3, 4)])", "all over a generator"),
    ("assert all([add(2, 3)])", "all over the reply's values"),
    ("assert any([add(2, 3)])", "any"),
    ("import math\nassert math.isclose(add(2, 3), 5) == True", "math.isclose == True"),
    ("import math\nassert math.isclose(add(2, 3), 5) is True", "math.isclose is True"),
    ("assert isinstance(add(2, 3), int)", "isinstance"),
    ("import operator\nassert operator.eq(add(2, 3), 5)", "operator.eq"),
    ("assert add(2, 3).__eq__(5)", "a dunder call"),
    ("assert (x := add(2, 3)) == 5", "walrus"),
    ("assert max(add(2, 3), 5) == 5", "max of the reply's value and the expected one"),
    ("assert [add(2, 3) == 5][0]", "a comparison inside a list"),
    ("assert (lambda: add(2, 3) == 5)()", "a comparison inside a lambda"),
    ("assert add(2, 3) == 5 == 5", "chained comparison"),
    ("assert add(2, 3) in [5] or True", "or True"),
    ("assert not not add(2, 3)", "not not"),
    ("import numpy\nassert numpy.allclose(add(2, 3), 5)", "a library predicate"),
    ("assert add(2, 3) == 5 and (add(1, 1) == 2) == True", "a bypass inside an and"),
    ([{"call": "add(2, 3) == 5", "expect": True}], "a comparison in a call row"),
    ([{"call": "all([add(2, 3)])", "expect": True}], "all in a call row"),
]


@pytest.mark.parametrize("tests,name", BYPASSES, ids=[n for _, n in BYPASSES])
def test_every_bypass_is_an_unsupported_test_never_a_pass(tests, name):
    with pytest.raises(RewardError) as caught:
        code_reward(completion=f"```python\n{GAMER}```", task={"tests": tests})
    assert caught.value.reason == "unsupported_test", caught.value
    assert "tests line" in str(caught.value) or "test object" in str(caught.value)


def test_the_checks_decided_here_pass_only_what_they_say():
    # Truth checks: a plain bool only (the issue 46 survivor: a 1 passed "is True" under a mutant).
    for value, truthy in [(True, True), (1, False), (1.0, False), ([1], False), ("yes", False),
                          (None, False)]:
        assert passes(Case("f()", "truthy"), value) is truthy, value
        assert passes(Case("f()", "is_true"), value) is truthy, value
    for value, falsy in [(False, True), (0, False), (None, False), ([], False), ("", False)]:
        assert passes(Case("f()", "falsy"), value) is falsy, value
        assert passes(Case("f()", "is_false"), value) is falsy, value
    # == / != keep Python's meaning; containment both ways; JSON rows compare tuples as lists.
    assert passes(Case("f()", "eq", 5), 5) and not passes(Case("f()", "eq", 5), 6)
    assert passes(Case("f()", "contains", 3), [1, 3]) and not passes(Case("f()", "contains", 3), [1])
    assert passes(Case("f()", "not_contains", 3), "abc") is False  # a TypeError is a failure
    assert passes(Case("f()", "eq", [3, 1], as_json=True), (3, 1))
    assert not passes(Case("f()", "eq", [3, 1]), (3, 1))


def test_documented_forms_are_read_into_checks_made_here():
    imports, cases = parse_tests([
        "import math", "from solution import helper", "assert f(1) == True", "assert f(2) != False",
        "assert not f(3)", "assert f(4) is not True", "assert 3 in f(5)", "assert 4 not in f(6)",
        "assert Stack().empty()", "assert f(7).is_ok()", "assert helper(1)", "assert sorted(f(8)) == [1]",
        "assert len(f(9)) == 2", {"call": "f(10)", "expect": 5},
        {"call": "f(11)", "expect": 0.3, "abs_tol": 1e-6},
        {"call": "f(12)", "expect": None}, {"call": "f(13)", "expect": False}])
    assert imports == ["import math", "from solution import helper"]
    assert [(c.expr, c.check, c.expected) for c in cases] == [
        ("f(1)", "is_true", None), ("f(2)", "is_true", None), ("f(3)", "falsy", None),
        ("f(4)", "is_false", None),
        ("f(5)", "contains", 3), ("f(6)", "not_contains", 4), ("Stack().empty()", "truthy", None),
        ("f(7).is_ok()", "truthy", None), ("helper(1)", "truthy", None), ("sorted(f(8))", "eq", [1]),
        ("len(f(9))", "eq", 2), ("f(10)", "eq", 5), ("f(11)", "close", 0.3), ("f(12)", "is_none", None),
        ("f(13)", "is_false", None)]
    assert cases[12].abs_tol == 1e-6 and cases[12].rel_tol == 0.0 and cases[11].as_json
    # What the tests import from a library is not the reply's (a truth check of it is refused);
    # what they import from anything else (the package a repo task's model edits) is.
    own = parse_tests("from pkg.mod import even\nassert even(4) == True")[1]
    assert [c.check for c in own] == ["is_true"]
    for library in ("from os.path import exists\nassert exists(f())",
                    "import numpy as np\nassert np.any(f())",
                    "from re import fullmatch as m\nassert m('a+', f()) is not None",
                    "from builtins import all as every\nassert every(f()) == True", "assert not len(f())",
                    "assert not sorted(f())"):
        with pytest.raises(RewardError, match="unsupported_test"):
            parse_tests(library)
    # A malformed row is still a plain ValueError (the dataset's fault), not unsupported_test.
    for bad in ([{"call": "f(1)"}], [{"call": 3, "expect": 1}], [{"call": "f(", "expect": 1}],
                [{"call": "f(1)", "expect": 1, "extra": 2}], [{"call": "f(1)", "expect": "x", "abs_tol": 1}]):
        with pytest.raises(ValueError) as caught:
            parse_tests(bad)
        assert not isinstance(caught.value, RewardError), bad


FORMS = ["import math",
         "assert add(2, 3) == 5", "assert add(2, 3) != 4", "assert nothing(1) is None",
         "assert even(2) is True and even(3) is False", "assert even(4) == True", "assert even(4)",
         "assert not even(5)", "assert add(1, 1) in [2, 3]", "assert add(1, 1) not in [-1]",
         "assert 2 in pair(1)",
         "assert math.isclose(third(1), 0.3333333, rel_tol=1e-6)", "assert abs(third(1) - 0.333) < 0.001",
         "assert sorted(pair(1)) == [1, 2]", "assert len(pair(1)) == 2", "assert Box(3).value() == 3",
         "assert Box(0).empty()", "assert pair(1) == (1, 2)", "assert blob() == {'k': {1}, 'b': b'x'}",
         {"call": "add(2, 3)", "expect": 5}, {"call": "pair(1)", "expect": [1, 2]},
         {"call": "third(1)", "expect": 0.3333333, "abs_tol": 1e-6}, {"call": "even(6)", "expect": True},
         {"call": "nothing(0)", "expect": None}, "assert one() is True", "assert one() == True"]
RIGHT = """
def add(a, b): return a + b
def nothing(x): return None
def even(n): return n % 2 == 0
def pair(x): return (x, x + 1)
def third(x): return x / 3
def blob(): return {'k': {1}, 'b': b'x'}
def one(): return True
class Box:
    def __init__(self, v): self.v = v
    def value(self): return self.v
    def empty(self): return self.v == 0
"""
# Wrong in every test, and truthy-but-not-True where a bool is due (1, [1], 0, None, "").
WRONG = """
def add(a, b): return a * b - 2
def nothing(x): return 0
def even(n): return [1] if n % 2 == 0 else ([] if n == 5 else 1)
def pair(x): return [x + 5, x + 6, x]
def third(x): return x / 4
def blob(): return {'k': [1], 'b': 'x'}
def one(): return 1
class Box:
    def __init__(self, v): self.v = v
    def value(self): return str(self.v)
    def empty(self): return 1
"""


@needs_sandbox
def test_every_documented_form_passes_a_right_solution_and_fails_a_wrong_one():
    n = len(parse_tests(FORMS)[1])
    right = code_reward(completion=f"```python\n{RIGHT}```", task={"tests": FORMS})
    assert right == {"reward": 1.0, "tests_passed": 1.0}
    wrong = code_reward(completion=f"```python\n{WRONG}```", task={"tests": FORMS})
    assert wrong == {"reward": 0.0, "tests_passed": 0.0}, (wrong, n)


NOT_PLAIN = ALWAYS_EQUAL + """
class T:
    def __bool__(self): return True
def even(n): return T()
class F(float):
    pass
def third(x): return F(0.3333333)
class C:
    def __contains__(self, x): return True
def pair(x): return C()
def listed(): return [1, object()]
"""


@needs_sandbox
def test_values_that_are_not_plain_data_are_named():
    # An always-equal object, its own __bool__, a float subclass, its own __contains__, an object
    # inside a list: each of the five tests gets a value that is not plain data, the first is named.
    tests = ["assert add(2, 3) == 5", "assert even(3)", "assert abs(third(1) - 0.3333333) < 1e-6",
             "assert 9 in pair(1)", {"call": "listed()", "expect": [1, 2]}]
    with pytest.raises(RewardError) as caught:
        code_reward(completion=f"```python\n{NOT_PLAIN}```", task={"tests": tests})
    assert caught.value.reason == "non_plain_value", caught.value
    assert "test 0 ('add(2, 3)') gave a Yes, not plain data (5 of 5 tests)" in str(caught.value), caught.value


@needs_sandbox
def test_through_the_pool_the_reasons_are_counted():
    pool = RewardPool("code", workers=1, timeout_s=30)
    try:
        right = pool.score(completion=RIGHT, answer=None, prompt="", task={"tests": FORMS})
        bypass = pool.score(completion=GAMER, answer=None, prompt="",
                            task={"tests": ["assert add(2, 3) == 5 or add(2, 3) == 6"]})
        # (not GAMER: its patched isinstance breaks the jail's json encoder, a plain failed test)
        object_ = pool.score(completion=ALWAYS_EQUAL, answer=None, prompt="",
                             task={"tests": ["assert add(2, 3) == 5"]})
    finally:
        pool.close()
    assert (right.reward, right.error, right.metrics) == (1.0, None, {"tests_passed": 1.0}), right
    for result, reason in ((bypass, "unsupported_test"), (object_, "non_plain_value")):
        assert result.reward == 0.0 and f"RewardError: {reason}: " in result.error, result
        # The worker counts a RewardError under its own reason once envs/rewards/worker.py maps
        # RewardError.reason (the change is the lead's to make); until then it is an exception.
        assert result.reason == reason, result
