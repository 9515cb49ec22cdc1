"""The ``code`` reward cannot be gamed: a wrong solution scores 0 however it exits, whatever its
objects claim to equal, whatever it patches, reads or prints; a right one scores 1.

Every case runs the real harness in the real sandbox (root + namespaces); each attack below scored
1.0 when the tests were appended to the solution and graded by exit status."""

import json
import time

import pytest

from envs.rewards import RewardPool
from envs.rewards.builtin import code_reward
from envs.rewards.code_harness import Case, decode, grade, parse_tests
from envs.rewards.errors import RewardError
from envs.sandbox import sandbox_available

TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(10, -4) == 6"]
RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a * b\n"
READS_THE_TESTS = r'''
import os, re
def add(a, b):
    # Look for "add(a, b) == y" in every file it can see, its own included.
    paths = [__file__] + [os.path.join("/work", n) for n in os.listdir("/work")]
    for path in paths:
        try:
            text = open(path).read()
        except OSError:
            continue
        for m in re.finditer(r"add\((-?\d+), (-?\d+)\) == (-?\d+)", text):
            if (int(m.group(1)), int(m.group(2))) == (a, b):
                return int(m.group(3))
    return 0
'''
CLAIMS_EVERY_VALUE = r'''
import json, os, sys
nonce = sys.argv[1] if len(sys.argv) > 1 else ""
for i in range(3):
    for v in range(-20, 21):
        os.write(1, ("\n" + nonce + json.dumps({"i": i, "v": v}) + "\n").encode())
os._exit(0)
'''
CLAIMS_A_GUESS = r'''
import json, os, sys
nonce = sys.argv[1] if len(sys.argv) > 1 else ""
for i in range(3):
    print(nonce + json.dumps({"i": i, "v": 5}))
print("PASS")
print("OK (3 tests)")
os._exit(0)
'''
ATTACKS = {
    "os._exit(0)": WRONG + "import os\nos._exit(0)\n",
    "sys.exit(0)": WRONG + "import sys\nsys.exit(0)\n",
    "raise SystemExit": WRONG + "raise SystemExit(0)\n",
    "atexit exits 0": WRONG + "import atexit, os\natexit.register(lambda: os._exit(0))\n",
    "excepthook exits 0": WRONG + "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n",
    "always-equal object": "class Any:\n    def __eq__(self, other):\n        return True\n\n"
                           "def add(a, b):\n    return Any()\n",
    "int subclass, patched eq": "class I(int):\n    def __eq__(self, other):\n        return True\n"
                                "    __hash__ = int.__hash__\n\ndef add(a, b):\n    return I(0)\n",
    "str subclass, patched eq": "class S(str):\n    def __eq__(self, other):\n        return True\n"
                                "    __hash__ = str.__hash__\n\ndef add(a, b):\n    return S('')\n",
    "patched builtins and json": WRONG + "import builtins, json\nbuiltins.type = lambda o: int\n"
                                 "json.dumps = lambda *a, **k: '5'\n",
    "json claims one result": WRONG + "import json\njson.dumps = lambda *a, **k: '{\"i\": 0, \"v\": 5}'\n",
    "patched eval": WRONG + "import builtins\nbuiltins.eval = lambda *a, **k: 5\n",
    "patched unittest and stdout": WRONG + "import io, sys, unittest\n"
                                   "unittest.TestCase.assertEqual = lambda *a, **k: None\n"
                                   "sys.stdout = io.StringIO()\n",
    "reads the test file": READS_THE_TESTS,
    "claims every value": CLAIMS_EVERY_VALUE,
    "claims a guess, prints PASS": CLAIMS_A_GUESS,
}

needs_sandbox = pytest.mark.skipif(not sandbox_available(), reason="needs root + unshare (namespaces)")


NON_PLAIN = {"always-equal object": "Any", "int subclass, patched eq": "I", "str subclass, patched eq": "S"}


def _score(program: str, tests=TESTS) -> dict:
    """The reward's dict, or ``{"reward": 0.0, "reason": ...}`` where it raised a RewardError
    (the pool scores that 0 and counts its reason)."""
    try:
        return code_reward(completion=f"```python\n{program}```", task={"tests": tests})
    except RewardError as e:
        return {"reward": 0.0, "reason": e.reason, "error": str(e)}


@needs_sandbox
@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_wrong_solution_scores_zero_however_it_games(name):
    result = _score(ATTACKS[name])
    assert result["reward"] == 0.0
    # A value that is not plain data is named as such, with its type: not a silent failed test.
    assert result.get("reason") == ("non_plain_value" if name in NON_PLAIN else None), result
    if name in NON_PLAIN:
        assert f"gave a {NON_PLAIN[name]}, not plain data" in result["error"], result


@needs_sandbox
def test_right_solutions_score_one_and_partial_ones_count_their_tests():
    assert _score(RIGHT) == {"reward": 1.0, "tests_passed": 1.0}
    # Prints, its own "PASS" lines and an excepthook do not change a right answer.
    assert _score("print('PASS')\nimport sys\nsys.excepthook = None\n" + RIGHT)["reward"] == 1.0
    half = "def add(a, b):\n    return a + b if a > 0 else 7\n"
    assert _score(half) == {"reward": 0.0, "tests_passed": pytest.approx(2 / 3)}
    assert _score(WRONG) == {"reward": 0.0, "tests_passed": 0.0}
    # A right module that exits while it is imported gives no values: 0.
    assert _score(RIGHT + "import os\nos._exit(0)\n")["reward"] == 0.0
    # Every supported form, with plain values of every kind, and the test's own imports.
    forms = ["import math", "assert f(0) == (1, [2.5, None], {'k': {3}}, b'x', set())",
             "assert f(1) != 2", "assert f(2) is None", "assert f(3)", "assert not f(4)",
             "assert f(5) in [1, 2, 3]", "assert math.isclose(f(6), 0.3, rel_tol=1e-9)",
             "assert abs(f(7) - 2.0) < 0.01", "assert f(3) is True and f(4) is False"]
    program = ("def f(x):\n    return [(1, [2.5, None], {'k': {3}}, b'x', frozenset()), 3, None, True,\n"
               "            False, 2, 0.1 + 0.2, 2.001][x]\n")
    assert _score(program, forms) == {"reward": 1.0, "tests_passed": 1.0}


@needs_sandbox
def test_the_sandbox_ends_within_the_reward_calls_own_timeout(monkeypatch):
    pool = RewardPool("code", workers=1, timeout_s=2.5)
    try:
        loop = "```python\nwhile True:\n    pass\n```"
        t0 = time.monotonic()
        r = pool.score(completion=loop, answer=None, prompt="", task={"tests": TESTS})
        # The sandbox's 5 s was cut to fit the call's 2.5 s: a plain 0, not a killed call.
        assert (r.reward, r.reason, r.timed_out) == (0.0, None, False) and time.monotonic() - t0 < 10
    finally:
        pool.close()


def test_tests_are_split_so_the_expected_values_stay_outside():
    imports, cases = parse_tests("import math\nassert add(2, 3) == 5\nassert 0 == add(-1, 1)\n"
                                 "assert abs(area(2) - 12.56) <= 0.01")
    assert imports == ["import math"]
    assert [(c.expr, c.check, c.expected) for c in cases] == [
        ("add(2, 3)", "eq", 5), ("add(-1, 1)", "eq", 0), ("area(2)", "close", 12.56)]
    for bad, why in [("assert f(1) == g(2)", "must be a literal"), ("for i in range(3):\n    pass", "For"),
                     ("assert 1 < f(1) < 3", "chained"), ("assert f(1) > 2", "unsupported comparison"),
                     ("x = 3", "Assign"), ("assert f(", "do not parse"), ("import os", "no assert")]:
        with pytest.raises(ValueError, match=why):
            parse_tests(bad)


def test_result_lines_are_claims_checked_strictly_here():
    cases = [Case("f(1)", "eq", 5), Case("f(2)", "eq", (1, 2))]

    def line(frame):
        return "n0nce" + json.dumps(frame)

    ok = "\n".join(["noise", line({"i": 0, "v": 5}), line({"i": 1, "v": {"$": "tuple", "v": [1, 2]}})])
    assert grade(ok, "n0nce", cases) == (2, None)
    # A list is not the tuple the test expects; a missing line fails its test.
    assert grade(line({"i": 0, "v": 5}) + "\n" + line({"i": 1, "v": [1, 2]}), "n0nce", cases) == (1, None)
    assert grade(line({"i": 0, "v": 5}), "n0nce", cases) == (1, None)
    # Two lines for one test void the run (else every value could be claimed), as does a stray index.
    assert grade(ok + "\n" + line({"i": 0, "v": 6}), "n0nce", cases)[0] == 0
    assert grade(ok + "\n" + line({"i": 7, "v": 6}), "n0nce", cases)[0] == 0
    for bad in ({"$": "object", "v": []}, {"$": "tuple", "v": [], "x": 1}, {"__eq__": True}):
        with pytest.raises(ValueError):
            decode(bad)
