"""The ``repo`` task's tools and its grading, all run inside sandboxes.

Tools: each call becomes one run of ``TOOL_SCRIPT`` (standard library only) in the episode's
sandbox, the request passed as base64 JSON in its argument list, so a path, a string to replace or
a line range the model wrote is only ever data to a process in the jail. What the model's code
does there (a test run imports it) can change the script's files or output: that only changes the
next observation, never the reward.

Grading (``grade_package``): the package's module files are read back by descriptor
(``envs.jail_files``: no symlink followed, no FIFO opened, size capped; a refused file counts its
reason and grades as empty), written into a *fresh* sandbox, and the task's tests are evaluated
by the ``code`` reward's harness (``envs.rewards.code_harness``): the asserts are split here, the
expressions evaluated in the jail, the values compared here against expected values that never
enter it. The model's edits to ``tests/`` are never read.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envs.jail_files import JailFileError, read_jail_text
from envs.rewards.code_harness import EVALUATOR, grade, parse_tests
from envs.sandbox import Sandbox, SandboxLimits, SandboxResult
from envs.untrusted import escape_added_tokens, run_untrusted

NUDGE = "Call a tool: read_file, replace, replace_lines, run_tests, or submit when the tests pass."
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _tool(name: str, description: str, **props: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in props.items()},
                       "required": list(props)}}}


TOOLS = [
    _tool("read_file", "Show a file with line numbers.", path="string"),
    _tool("replace", "Replace the one occurrence of old in a file with new.", path="string", old="string",
          new="string"),
    _tool("replace_lines", "Replace lines start..end (1-based, inclusive) of a file with text.",
          path="string", start="integer", end="integer", text="string"),
    _tool("run_tests", "Run every test in tests/ and show which fail."),
    _tool("submit", "Finish: the package is graded by its tests."),
]
NAMES = tuple(t["function"]["name"] for t in TOOLS)


def parse_calls(text: str) -> tuple[list[dict[str, Any]], int]:
    """``([{"name", "arguments"}, ...], malformed)``: well-formed calls of a known tool with an
    arguments object, and how many ``<tool_call>`` blocks were anything else (or never closed)."""
    calls, malformed = [], 0
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            malformed += 1
            continue
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        if not (isinstance(call, dict) and call.get("name") in NAMES and isinstance(args, dict)):
            malformed += 1
            continue
        calls.append({"name": call["name"], "arguments": args})
    if "<tool_call>" in text:
        malformed += max(0, text.count("<tool_call>") - text.count("</tool_call>"))
    return calls, malformed


# Runs as ``python3 -I -S -c TOOL_SCRIPT <base64 request>`` in the jail's task directory.
TOOL_SCRIPT = r'''
import base64, glob, json, os, sys
req = json.loads(base64.b64decode(sys.argv[1]))
op, a = req["name"], req["arguments"]

def fail(msg):
    print("error: " + msg)
    sys.exit(3)

def path_arg():
    p = a.get("path")
    if not isinstance(p, str) or not p or p.startswith("/") or ".." in p.split("/"):
        fail("path must be a relative path inside the task directory, got %r" % (p,))
    return p

def read(p):
    try:
        with open(p, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as e:
        fail("%s: %s" % (p, e.strerror))

def write(p, text):
    try:
        with open(p, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        fail("%s: %s" % (p, e.strerror))

if op == "read_file":
    p = path_arg()
    lines = read(p).splitlines()
    print("\n".join("%4d  %s" % (i, line) for i, line in enumerate(lines, 1)) or "(empty file)")
elif op == "replace":
    p = path_arg()
    old, new = a.get("old"), a.get("new")
    if not isinstance(old, str) or not old or not isinstance(new, str):
        fail("replace takes strings old (not empty) and new")
    text = read(p)
    n = text.count(old)
    if n != 1:
        fail("old occurs %d times in %s; it must occur exactly once" % (n, p))
    write(p, text.replace(old, new, 1))
    print("ok: replaced 1 occurrence in %s" % p)
elif op == "replace_lines":
    p = path_arg()
    start, end, new = a.get("start"), a.get("end"), a.get("text")
    if type(start) is not int or type(end) is not int or not isinstance(new, str):
        fail("replace_lines takes integers start, end and a string text")
    lines = read(p).splitlines(True)
    if not 1 <= start <= end + 1 or end > len(lines):
        fail("lines %d..%d are not in %s (%d lines)" % (start, end, p, len(lines)))
    body = new if not new or new.endswith("\n") else new + "\n"
    write(p, "".join(lines[:start - 1]) + body + "".join(lines[end:]))
    print("ok: lines %d-%d of %s replaced" % (start, end, p))
elif op == "run_tests":
    sys.path.insert(0, os.getcwd())
    passed = total = 0
    for f in sorted(glob.glob("tests/test_*.py")):
        ns = {}
        for n, line in enumerate(read(f).splitlines(), 1):
            s = line.strip()
            if s.startswith(("import ", "from ")):
                try:
                    exec(s, ns)
                except BaseException as e:
                    print("%s:%d: import failed: %s: %s" % (f, n, type(e).__name__, str(e)[:200]))
            elif s.startswith("assert "):
                total += 1
                try:
                    exec(s, ns)
                    passed += 1
                except BaseException as e:
                    got = ""
                    if isinstance(e, AssertionError) and " == " in s:
                        try:
                            got = ", got %r" % (eval(s[7:].split(" == ")[0], ns),)
                        except BaseException:
                            pass
                    print("FAIL %s:%d: %s (%s%s)" % (f, n, s, type(e).__name__, got))
    print("%d of %d tests pass" % (passed, total))
else:
    fail("unknown tool %r" % (op,))
'''


class TrustedDir:
    """A temporary directory that runs commands without a jail, for the scripted demonstration
    only: it runs the tool script on our own generated package (no model output), and a
    demonstration per warm-start sequence through namespaces and cgroups would cost about a
    second each. Same ``write_file`` / ``run`` / ``close`` as ``Sandbox``, same tool script."""

    def __init__(self, wall_seconds: float = 10.0):
        import tempfile

        self._tmp = tempfile.TemporaryDirectory(prefix="mixrl-repo-demo-")
        self.workdir = Path(self._tmp.name)
        self.wall_seconds, self.cgroup, self.isolated = wall_seconds, None, False

    def write_file(self, name: str, content: str) -> None:
        path = self.workdir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)

    def run(self, command: str) -> SandboxResult:
        proc = subprocess.run(["/bin/sh", "-c", command], cwd=self.workdir, env={"PATH": "/usr/bin:/bin"},
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=self.wall_seconds, check=False)
        return SandboxResult(output=proc.stdout.decode("utf-8", errors="replace"), exit_code=proc.returncode,
                             timed_out=False, output_truncated=False, isolated=False)

    def run_calls(self, calls: list[dict]) -> list[str]:
        """Each call's result text, as ``run_tool`` would give it, all in one interpreter (a
        process per call is most of a demonstration's cost): the script runs once per call with
        the modules it imported dropped again, so a later test run sees the edited files."""
        requests = [base64.b64encode(json.dumps(c).encode()).decode() for c in calls]
        command = f"exec /usr/bin/python3 -I -S -c {shlex.quote(_MANY)} {shlex.quote(json.dumps(requests))}"
        parts = self.run(command).output.split(_SEPARATOR)
        if len(parts) != len(calls) + 1:
            raise RuntimeError(f"repo demonstration: {len(parts) - 1} results for {len(calls)} calls")
        return [(p.rstrip() or "(no output)") for p in parts[:-1]]

    def close(self) -> None:
        self._tmp.cleanup()


_SEPARATOR = "\x00--mixrl-call-end--\x00"
_MANY = (r"""
import contextlib, io, json, sys
SCRIPT = @SCRIPT@
before = set(sys.modules)
for request in json.loads(sys.argv[1]):
    out = io.StringIO()
    sys.argv = ["-c", request]
    with contextlib.redirect_stdout(out):
        try:
            exec(SCRIPT, {"__name__": "__main__"})
        except SystemExit:
            pass
    for name in set(sys.modules) - before:
        del sys.modules[name]
    sys.stdout.write(out.getvalue() + @SEPARATOR@)
""".replace("@SCRIPT@", repr(TOOL_SCRIPT)).replace("@SEPARATOR@", repr(_SEPARATOR)))


def run_tool(sandbox: Sandbox, call: dict, note_error: Callable[[str], None], tokenizer) -> tuple[str, bool]:
    """``(result text, ok)`` of one call run in ``sandbox``; the text has the tokenizer's added
    tokens broken (``envs.untrusted``) so command output never becomes a control token."""
    request = base64.b64encode(json.dumps(call).encode()).decode()
    command = f"exec /usr/bin/python3 -I -S -c {shlex.quote(TOOL_SCRIPT)} {request}"
    output, marker = run_untrusted(sandbox, command, note_error)
    output, escaped = escape_added_tokens(tokenizer, output)
    if escaped:
        note_error("special_tokens")
    ok = not marker and not output.startswith("error:")
    return (output + marker).rstrip() or "(no output)", ok


def grade_package(workdir, payload: dict, limits: SandboxLimits, note_error: Callable[[str], None], *,
                  allow_unisolated: bool = False, allow_unbounded_memory: bool = False) -> float:
    """Share of ``payload["tests"]`` passing on the package's modules as they are in ``workdir``."""
    imports, cases = [], []
    for text in payload["tests"].values():
        more_imports, more_cases = parse_tests(text)  # ours: a bad one is a bug, raised
        imports += more_imports
        cases += more_cases
    files = {}
    for path in payload["sources"]:
        try:
            files[path] = read_jail_text(workdir, path)
        except JailFileError as e:
            note_error(e.reason)  # file_missing, file_symlink, file_too_large, ...
            files[path] = ""
    nonce = "@@mixrl-" + secrets.token_hex(8)
    with Sandbox(limits, allow_unisolated=allow_unisolated,
                 allow_unbounded_memory=allow_unbounded_memory) as box:
        for path, text in files.items():
            box.write_file(path, text)
        box.write_file("solution.py", "")
        exprs = [c.expr for c in cases]
        box.write_file(".mixrl_cases.json", json.dumps({"imports": imports, "exprs": exprs}))
        # The package imports from the task directory (``-I`` leaves it off sys.path).
        evaluator = EVALUATOR if box.isolated else EVALUATOR.replace('"/work/', '"')  # cwd: the work dir
        box.write_file(".mixrl_eval.py", "import os, sys\nsys.path.insert(0, os.getcwd())\n" + evaluator)
        result = box.run(f"exec /usr/bin/python3 -I .mixrl_eval.py {nonce}")
    passed, void = grade(result.output, nonce, cases)
    if void is not None:
        note_error("grade_void")
        return 0.0
    return passed / len(cases)


__all__ = ["NAMES", "NUDGE", "TOOLS", "TOOL_SCRIPT", "TrustedDir", "grade_package", "parse_calls", "run_tool"]
