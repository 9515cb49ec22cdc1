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
CALLS = [0]  # bumped by each call: a call starts from the module as loaded, so it is always 1


def returns_value(*, completion, answer, prompt, task):
    """The row's ``value`` as it is (a number or a dict with ``reward``); with ``where``, where
    the call runs instead: whether the module was loaded by the call's parent (the worker), once,
    and whether the call runs in a process of its own under another uid than ``trainer_uid``."""
    if "where" not in task:
        return task["value"]
    CALLS[0] += 1
    return {"reward": 1.0, "loaded_by_parent": float(IMPORT_PID == os.getppid()),
            "own_process": float(os.getpid() != IMPORT_PID), "calls_seen": float(CALLS[0]),
            "other_uid": float(os.getuid() != task["trainer_uid"])}
