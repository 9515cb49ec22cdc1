"""Reward functions of a 'user' for the tests: importable as ``user_rewards:<name>`` from tests/envs."""

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
