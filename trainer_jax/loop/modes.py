"""How the loop takes groups and publishes versions: asynchronous (the default) or synchronous.

A mode is the loop's take/publish policy, the one thing ``train.sync`` changes:

- ``source``: what the rollout service hands out tasks from;
- ``take(take, version)``: the step's P complete prompt groups, from ``take(n)`` (the buffer);
- ``carry``: how many samples that did not fit a batch may go into the next one;
- ``first(version, publishing)`` / ``publish(version, publishing)``: the first version, and each
  later one (every ``train.publish_every`` steps, which synchronous mode requires to be 1);
- ``metrics()``: what the mode adds to each step's record.

``Asynchronous`` trains on whatever the buffer holds and publishes in the background, so the next
step never waits for a publish. ``Synchronous`` (``trainer_jax.sync``) trains step s only on
samples of version s: tasks are gated by version, groups with a token of another version are
replaced, leftovers are never carried, and each version is published before the next tasks are
released.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainer_jax.config import RunConfig
from trainer_jax.loop.publish import Publishing
from trainer_jax.service.tasks import TaskSource
from trainer_jax.sync import SyncTasks

Take = Callable[[int], list]


class Asynchronous:
    """``train.sync: false``: the first P complete groups, whatever version made them."""

    def __init__(self, cfg: RunConfig, source: TaskSource):
        self.source = source
        self.prompts = cfg.train.prompts_per_step
        self.carry = cfg.train.prompts_per_step * cfg.tasks.group_size  # at most one batch

    def take(self, take: Take, version: int) -> list:
        return take(self.prompts)

    def first(self, version: int, publishing: Publishing) -> dict[str, Path]:
        return publishing.now(version)

    def publish(self, version: int, publishing: Publishing) -> None:
        publishing.request(version)

    def metrics(self) -> dict[str, float]:
        return {}


class Synchronous:
    """``train.sync: true``: step s takes P groups generated entirely by version s."""

    def __init__(self, cfg: RunConfig, source: TaskSource):
        self.source = self.gate = SyncTasks(source, cfg.train.prompts_per_step)
        self.prompts = cfg.train.prompts_per_step
        self.carry = 0  # what did not fit is of this version: never train it later

    def take(self, take: Take, version: int) -> list:
        return self.gate.take(take, self.prompts, version)

    def publish(self, version: int, publishing: Publishing) -> dict[str, Path]:
        # The next step's tasks wait for this version, on disk and announced.
        paths = publishing.now(version)
        self.gate.release(version)
        return paths

    first = publish

    def metrics(self) -> dict[str, float]:
        return {"sync/dropped_groups_total": self.gate.dropped_groups}


MODES: dict[bool, type[Asynchronous] | type[Synchronous]] = {False: Asynchronous, True: Synchronous}


def loop_mode(cfg: RunConfig, source: TaskSource) -> Asynchronous | Synchronous:
    """The mode ``train.sync`` names, over the run's task source."""
    return MODES[cfg.train.sync](cfg, source)


__all__ = ["MODES", "Asynchronous", "Synchronous", "loop_mode"]
