"""A reward function that misbehaves as its row says, for tests/envs/test_reward_workers.py and
tests/envs/test_reward_isolation.py: ``hostile_rewards:hostile`` (importable from tests/envs);
``task["do"]`` names the behaviour, and ``task["r"]`` is the reward it returns when it returns one
(so a test sees which request an answer belongs to). The attacks on the call's isolation
(``do: "attack"``, ``task["what"]``) return the reward with metrics saying what each attempt got
(``errno``: 0 when it succeeded)."""

import ctypes
import os
import subprocess
import sys
import time

from hostile_attacks import ATTACKS

FORGED = b'{"id": %d, "ok": true, "value": {"reward": 1000000.0, "metrics": {}}}\n'


def plain(task):
    """The row's reward ``r``: lets a test see which request an answer belongs to."""
    return float(task["r"])


def forks(task):
    """Both sides of a fork return: the child 0.9, the parent the row's reward."""
    if os.fork() == 0:
        return 0.9
    return float(task["r"])


def writes_everywhere(task):
    """Forged answers (for the next few request ids) on every descriptor that may be open."""
    for fd in range(1, 256):
        for rid in range(1, 8):
            try:
                os.write(fd, FORGED % rid)
            except OSError:
                break
    return float(task["r"])


def segfaults(task):
    ctypes.string_at(0)
    return 1.0


def allocates(task):
    return float(len(bytearray(int(task["bytes"]))) > 0) * float(task["r"])


def exits(task):
    os._exit(0)


def returns(task):
    huge = {"reward": 1.0, **{f"k{i}": i for i in range(10_000)}}
    kinds = {"nan": float("nan"), "text": "1.0", "huge": huge, "bool": True, "no_reward": {"score": 1.0}}
    return kinds[task["kind"]]


def leaves_children(task):
    """A child in a new session and a double-forked daemon, both sleeping; their pids in a file."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    pids = [child.pid]
    r, w = os.pipe()
    if os.fork() == 0:  # the daemon idiom: fork, setsid, fork, parent exits
        os.setsid()
        if os.fork() == 0:
            os.write(w, str(os.getpid()).encode())
            time.sleep(300)
        os._exit(0)
    os.wait()
    pids.append(int(os.read(r, 32)))
    with open(task["pids_file"], "w") as f:
        f.write(" ".join(map(str, pids)))
    if task.get("hang"):
        time.sleep(300)
    return float(task["r"])


def cleans_up(task):
    """Sleeps past its timeout; its ``finally`` (a sandbox's close()) must still run."""
    try:
        time.sleep(300)
    finally:
        with open(task["marker"], "w") as f:
            f.write("closed")
    return 1.0


def attack(task):
    return {"reward": float(task.get("r", 0.5)), **ATTACKS[task["what"]](task)}


BEHAVIOURS = {"attack": attack, "plain": plain, "forks": forks,
              "writes_everywhere": writes_everywhere, "segfaults": segfaults,
              "allocates": allocates, "exits": exits, "returns": returns, "leaves_children": leaves_children,
              "cleans_up": cleans_up}


def hostile(*, completion, answer, prompt, task):
    return BEHAVIOURS[task.get("do", "plain")](task)
