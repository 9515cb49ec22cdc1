"""Several trainer processes, one loop: process 0 decides, the others follow.

With several JAX processes every collective of the loop (a train step, the gather of a weights
publication, a checkpoint) must be entered by every process, in the same order, on the same
batch. Only process 0 talks to the rollout service, so only it knows what comes next: it
*announces* each collective as an ``Order`` (step, publish, calibrate, checkpoint, stop) in the JAX
coordination service's key-value store, then runs it; the other processes wait for the next
order (a blocking read of the store, not a device collective, so an evaluation of many minutes
on process 0 times nothing out) and run the same collective. Batches travel as one device
broadcast of fixed-shape arrays (``share``): the store moves only a few MB/s.

A process that dies must not leave the others hanging in a collective. ``PeerWatch`` (a thread
in every process) beats a counter in the store every second and reads the others'; when one
stops for ``timeout_s`` it prints one line naming that process and ends this one with exit
status 1 (``os._exit``: the main thread may be inside a collective that can never finish). A
process that finished its part says so first, so its silence afterwards is not a death. JAX's
own heartbeat (``trainer_jax.parallel.distributed``) is set longer, so this line is what a user
sees rather than the coordination service's abort.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

STEP, PUBLISH, CALIBRATE, CHECKPOINT, STOP = "step", "publish", "calibrate", "checkpoint", "stop"
PROBE = "probe"  # the version probe's forwards (trainer_jax.probe)
_ORDER, _BEAT, _DONE = "mixrl/order/{}", "mixrl/beat/{}", "mixrl/done/{}"
LOST_EXIT_CODE = 1


@dataclasses.dataclass(frozen=True)
class Order:
    """What every process runs next. ``failed`` (with ``stop``): process 0 stops on an error."""

    command: str
    step: int = 0
    version: int = 0
    failed: bool = False


def _client() -> Any:
    from jax._src import distributed

    return distributed.global_state.client


class PeerWatch:
    """Heartbeats through the coordination service; names a process that stops beating.

    ``on_lost(line)`` callbacks run (best effort) before the exit, e.g. process 0 stopping its
    sampler subprocesses.
    """

    def __init__(self, timeout_s: float, *, client: Any = None, interval_s: float = 1.0,
                 exit: Callable[[int], None] = os._exit):
        self.index, self.count = jax.process_index(), jax.process_count()
        self.timeout_s, self.interval_s = float(timeout_s), min(interval_s, timeout_s / 5)
        self.client = client if client is not None else _client()
        self.on_lost: list[Callable[[str], None]] = []
        self.lost: str | None = None
        self._exit = exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mixrl-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def finish(self) -> None:
        """This process is done with collectives: say so (its silence is no death), stop watching."""
        self._stop.set()
        try:
            self.client.key_value_set(_DONE.format(self.index), "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the coordinator may already be gone at the very end
            pass

    def _read(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(key)
        except Exception as e:  # noqa: BLE001 - NOT_FOUND is the only expected one
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise

    def _run(self) -> None:
        beats = 0
        seen: dict[int, tuple[str | None, float]] = {}
        store_ok = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                beats += 1
                self.client.key_value_set(_BEAT.format(self.index), str(beats), allow_overwrite=True)
                for peer in range(self.count):
                    if peer == self.index or self._read(_DONE.format(peer)) is not None:
                        continue
                    beat = self._read(_BEAT.format(peer))
                    if peer not in seen or seen[peer][0] != beat:
                        seen[peer] = (beat, now)
                    elif now - seen[peer][1] > self.timeout_s:
                        return self._lose(f"process {peer} of {self.count} stopped answering (no "
                                          f"heartbeat for {self.timeout_s:.0f} s): it died or hangs")
                store_ok = now
            except Exception as e:  # noqa: BLE001 - the store lives in process 0
                if self._stop.is_set():
                    return
                if now - store_ok > self.timeout_s:
                    return self._lose(f"process 0 of {self.count} (the coordinator) is unreachable "
                                      f"for {self.timeout_s:.0f} s: {' '.join(str(e).split())[:200]}")

    def wait_verdict(self, timeout_s: float) -> None:
        """Give the watch up to ``timeout_s`` to find a lost peer (it then ends the process)."""
        self._thread.join(timeout_s)

    def _lose(self, reason: str) -> None:
        self.lost = reason
        line = f"mixrl-train process {self.index}: {reason}; stopping"
        print(line, file=sys.stderr, flush=True)
        for callback in self.on_lost:
            try:
                callback(line)
            except Exception:  # noqa: BLE001 - exiting regardless
                pass
        sys.stdout.flush()
        self._exit(LOST_EXIT_CODE)


class Lockstep:
    """The loop's control plane for ``jax.process_count()`` processes (a no-op for one)."""

    def __init__(self, timeout_s: float = 30.0, *, poll_s: float = 1.0):
        self.index, self.count = jax.process_index(), jax.process_count()
        self.poll_ms = int(poll_s * 1000)
        self._seq = 0
        self.watch = PeerWatch(timeout_s).start() if self.count > 1 else None

    @property
    def leader(self) -> bool:
        return self.index == 0

    @property
    def multi(self) -> bool:
        return self.count > 1

    def announce(self, order: Order) -> None:
        """Process 0: publish the next order (then run its collective)."""
        if not self.multi:
            return
        client = _client()
        client.key_value_set(_ORDER.format(self._seq), json.dumps(dataclasses.asdict(order)))
        # Every order but the last is followed by a collective, so when order n is announced
        # every process has read order n - 2: drop it from the store.
        if self._seq >= 2:
            try:
                client.key_value_delete(_ORDER.format(self._seq - 2))
            except Exception:  # noqa: BLE001 - housekeeping only
                pass
        self._seq += 1

    def next_order(self) -> Order:
        """The other processes: wait for process 0's next order (the watchdog bounds the wait)."""
        client, key = _client(), _ORDER.format(self._seq)
        while True:
            try:
                raw = client.blocking_key_value_get(key, self.poll_ms)
                break
            except Exception as e:  # noqa: BLE001 - a timeout means: not yet, ask again
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self._seq += 1
        return Order(**json.loads(raw))

    def share(self, tree: Any) -> Any:
        """Process 0's ``tree`` (numpy arrays) on every process; the others pass any tree of the
        same shapes and dtypes (e.g. an empty batch)."""
        if not self.multi:
            return tree
        from jax.experimental import multihost_utils

        shared = multihost_utils.broadcast_one_to_all(tree, is_source=self.leader)
        return jax.tree.map(np.asarray, shared)

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Run a collective; if it fails (gloo / NCCL see a peer's socket close at once), let the
        watch name the peer before the error spreads into clean-up that would wait on it."""
        try:
            yield
        except Exception:
            if self.watch is not None:
                self.watch.wait_verdict(self.watch.timeout_s + 5 * self.watch.interval_s)
            raise

    def finish(self) -> None:
        if self.watch is not None:
            self.watch.finish()
