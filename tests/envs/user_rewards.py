"""Reward functions of a 'user' for the tests: importable as ``user_rewards:<name>`` from tests/envs."""

import os
import sys
import time


def length_bonus(*, completion, answer, prompt, task):
    return {"reward": float(completion.strip() == answer), "chars": len(completion), "label": "ignored",
            "torch_loaded": float("torch" in sys.modules), "saw_prompt": float("hello" in prompt)}


def raises(*, completion, answer, prompt, task):
    raise RuntimeError("boom from the user's code")


def sleeps(*, completion, answer, prompt, task):
    time.sleep(float(task.get("sleep", 30)))
    return 1.0


def prints_then_scores(*, completion, answer, prompt, task):
    print("noise on stdout")
    return 0.5


def returns_text(*, completion, answer, prompt, task):
    return "1.0"


IMPORT_PID = os.getpid()  # module-level state: set once, in the worker that imports the module


def returns_value(*, completion, answer, prompt, task):
    """The row's ``value`` as it is (a number or a dict with ``reward``)."""
    return task["value"]


def where_it_runs(*, completion, answer, prompt, task):
    """Which process loaded the module and which runs the call, and as whom."""
    return {"reward": 1.0, "import_pid": IMPORT_PID, "call_pid": os.getpid(), "uid": os.getuid()}
