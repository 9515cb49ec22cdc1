"""Exit with the parent: a sampler spawned by ``mixrl-train`` must not outlive its trainer.

The trainer starts its local samplers in their own sessions (so a Ctrl-C in the terminal reaches
the trainer, which stops them in order), which also means nothing kills them when the trainer dies
by SIGKILL, OOM or a lost node. Two mechanisms, because neither covers every case alone:

- Linux ``PR_SET_PDEATHSIG``: the kernel sends SIGTERM the moment the parent dies. It is armed
  here, in the sampler itself at start-up (a ``preexec_fn`` in the trainer is unsafe with
  threads), and it fires on the death of the *thread* that forked us, so it is only a fast path.
- A watchdog thread that polls the parent's pid every ``interval_s``: once our parent is no longer
  the given pid (we were re-parented) or the pid is gone, it sends SIGTERM to this process, then
  SIGKILL after ``grace_s`` if the orderly stop hangs.

Samplers that join by address (external fleets) never get ``--exit-with-parent`` and keep retrying
until the trainer returns.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("mixrl.sampler")

_PR_SET_PDEATHSIG = 1


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def parent_alive(pid: int) -> bool:
    """Whether we are still the child of ``pid`` and it is running."""
    return os.getppid() == pid and pid_alive(pid)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts: signal 0 is refused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_with_parent(pid: int, *, interval_s: float = 0.5, grace_s: float = 10.0,
                     use_pdeathsig: bool = True) -> None:
    """Stop this process soon after ``pid`` (its parent) dies; return at once.

    If the parent is already gone (it died between fork and here), the stop starts immediately.
    ``use_pdeathsig=False`` leaves only the watchdog (how it behaves where prctl is missing).
    """
    if use_pdeathsig:
        _set_pdeathsig(signal.SIGTERM)

    def watch() -> None:
        while parent_alive(pid):
            time.sleep(interval_s)
        log.warning("parent process %d is gone: stopping", pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)  # the orderly stop hung: do not linger as an orphan

    threading.Thread(target=watch, name="mixrl-parent-watch", daemon=True).start()
