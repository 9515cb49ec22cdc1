"""A reward module whose import-time code can stall the worker that imported it, for
tests/envs/test_reward_requests.py: ``stalling_reward:reward``.

At import it starts a thread that waits for the file named by ``STALL_TRIGGER``; the first worker
to see it removes it, writes ``<trigger>.stalled`` and calls libc's ``sleep`` through
``ctypes.PyDLL``, which holds the GIL: no Python code runs in that worker again, so it stops
reading its requests (the state a user's module left a worker in with a C call that never
releases the GIL). Only the worker that claimed the trigger stalls; the next one serves."""

import ctypes
import os
import threading
import time


def _stall(trigger: str) -> None:
    sleep_holding_the_gil = ctypes.PyDLL(None).sleep  # bound first: from the marker on, one call
    while True:
        try:
            os.unlink(trigger)  # claim it: one worker stalls, its replacement does not
        except FileNotFoundError:
            time.sleep(0.01)
            continue
        with open(trigger + ".stalled", "w"):
            pass
        sleep_holding_the_gil(3600)


if os.environ.get("STALL_TRIGGER"):
    threading.Thread(target=_stall, args=(os.environ["STALL_TRIGGER"],), daemon=True).start()


def reward(*, completion: str, answer, prompt: str = "", task: dict | None = None) -> float:
    """The row's ``r``: a test sees that the answer is its own."""
    return float((task or {}).get("r", 1.0))
