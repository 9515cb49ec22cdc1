"""Local sampler processes: ``mixrl-sample`` command lines, started, watched and stopped.

The trainer knows its local samplers only by command line and by what they say over the wire:
nothing here imports the sampler package (or torch). Each process gets its own session and log
file under ``<run>/logs``; external groups (``spawn: false``) join by address on their own.
Own sessions keep a terminal's Ctrl-C from reaching the samplers before the trainer stops them in
order; so that a trainer killed outright (SIGKILL, OOM) leaves no orphans, each sampler is told
the trainer's pid (``--exit-with-parent``) and stops within seconds of its death.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mixrl_wire.devices import spawned_env
from trainer_jax.config import RunConfig, SamplerGroupConfig


def sampler_command(group: SamplerGroupConfig, index: int, *, address: str, model_dir: Path,
                    token_file: Path, cache_dir: Path, episode_tokens: int,
                    exit_with_parent: int | None = None) -> list[str]:
    """The ``mixrl-sample`` command line of process ``index`` of ``group``; with
    ``exit_with_parent`` (the trainer's pid) the sampler stops when that process dies."""
    cmd = [sys.executable, "-m", "sampler_torch.cli", "--trainer", address, "--group", group.name,
           "--recipe", group.recipe, "--model-dir", str(model_dir), "--token-file", str(token_file),
           "--capacity", str(group.capacity), "--threads", str(group.threads),
           "--episode-tokens", str(episode_tokens), "--weights-transfer", "shared",
           "--name", f"{group.name}-{index}", "--weights-cache", str(cache_dir),
           "--device", group.device, "--compile", group.compile]
    for key in ("attention", "kv_cache_dtype", "logit_noise"):
        if getattr(group, key) is not None:
            cmd += ["--recipe-override", f"{key}={getattr(group, key)}"]
    if group.round_weights is not None:
        cmd += ["--recipe-override",
                f"round_weights={group.round_weights.bits}/{group.round_weights.block_size}"]
    if exit_with_parent is not None:
        cmd += ["--exit-with-parent", str(exit_with_parent)]
    return cmd


@dataclasses.dataclass
class _Life:
    """One process slot's restart state."""

    name: str
    cmd: list[str]
    started: float
    quick_deaths: int = 0             # deaths in a row, each within ``healthy_s`` of its start
    restart_at: float | None = None   # when the death was seen: the time its restart is due
    gave_up: bool = False


class LocalSamplers:
    """The ``spawn: true`` groups of a run config, as child processes.

    A process that exits while the run goes on (a crash, the OOM killer) is restarted with the same
    command by ``restart_dead``, which the trainer calls while it waits for samples: after
    ``backoff_s``, doubling for each death that comes within ``healthy_s`` of its start, up to
    ``max_backoff_s``; after ``max_quick_deaths`` such deaths in a row (a sampler that cannot
    start) the slot is given up, and ``all_dead`` is true once every slot is.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, *, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 healthy_s: float = 120.0, max_quick_deaths: int = 5):
        self.cfg, self.run_dir = cfg, run_dir
        self.logs = run_dir / "logs"
        self.processes: list[subprocess.Popen] = []
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.healthy_s, self.max_quick_deaths = healthy_s, max_quick_deaths
        self.restarts = 0  # over the run, every slot
        self._lives: list[_Life] = []
        self._stopping = False
        self._lock = threading.Lock()  # stop() may come from another thread (a lost peer)

    @property
    def groups(self) -> list[SamplerGroupConfig]:
        return [g for g in self.cfg.groups if g.spawn]

    def start(self, address: str, token_file: Path, model_dirs: dict[str, Path]) -> None:
        """Start every process; ``model_dirs`` maps weight formats to the initial weights."""
        self.logs.mkdir(exist_ok=True)
        for g in self.groups:
            for i in range(g.processes):
                cmd = sampler_command(g, i, address=address, model_dir=model_dirs[g.weight_format],
                                      token_file=token_file,
                                      # One cache per process: samplers materializing the same
                                      # delta version into one directory race and refuse it.
                                      cache_dir=self.run_dir / "sampler_cache" / f"{g.name}-{i}",
                                      episode_tokens=self.cfg.train.episode_tokens,
                                      exit_with_parent=os.getpid())
                self.launch(f"{g.name}-{i}", cmd)

    def launch(self, name: str, cmd: list[str]) -> subprocess.Popen:
        """Start one process (its own session; output to ``logs/<name>.log``, appended across
        restarts) and watch it: ``restart_dead`` restarts it with ``cmd``."""
        self.logs.mkdir(parents=True, exist_ok=True)
        self._lives.append(_Life(name, list(cmd), started=time.monotonic()))
        self.processes.append(self._spawn(name, cmd))
        return self.processes[-1]

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        # The sampler's slot among this host's spawned samplers (a restart keeps its slot), in
        # place of the trainer's launcher rank: device auto spreads them over the visible GPUs.
        slot = next(i for i, life in enumerate(self._lives) if life.name == name)
        with open(self.logs / f"{name}.log", "ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=spawned_env(os.environ, slot))

    def restart_dead(self) -> list[str]:
        """Restart the processes that exited and whose backoff has passed; one line per event
        (an exit noticed, a restart, a slot given up) for the trainer's console."""
        with self._lock:
            return [] if self._stopping else self._restart_due()

    def _restart_due(self) -> list[str]:
        now, events = time.monotonic(), []
        for i, (p, life) in enumerate(zip(self.processes, self._lives, strict=True)):
            code = p.poll()
            if code is None or life.gave_up:
                continue
            if life.restart_at is None:  # a death not seen before
                life.quick_deaths = life.quick_deaths + 1 if now - life.started < self.healthy_s else 1
                if life.quick_deaths > self.max_quick_deaths:
                    life.gave_up = True
                    events.append(f"sampler {life.name} exited (code {code}) {life.quick_deaths} times in a "
                                  f"row within {self.healthy_s:g}s of starting; not restarting it "
                                  f"(see {self.logs / life.name}.log)")
                    continue
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (life.quick_deaths - 1))
                life.restart_at = now + delay
                events.append(f"sampler {life.name} exited (code {code}); restarting it in {delay:.3g}s")
            if now >= life.restart_at:
                self.processes[i] = self._spawn(life.name, life.cmd)
                life.started, life.restart_at = time.monotonic(), None
                self.restarts += 1
                events.append(f"sampler {life.name} restarted ({self.restarts} sampler restarts this run)")
        return events

    def describe(self) -> str:
        return ", ".join(f"{g.name}:{g.recipe}" for g in self.groups)

    def wait_registered(self, registered: Callable[[], int], timeout_s: float) -> None:
        """Block until ``registered()`` counts every process, so no group starts the race late."""
        deadline = time.monotonic() + timeout_s
        while registered() < len(self.processes):
            dead = self.dead()
            if dead:
                raise RuntimeError(f"{len(dead)} sampler process(es) exited during start-up; see {self.logs}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {registered()} of {len(self.processes)} samplers registered within "
                                   f"train.sampler_start_timeout_s={timeout_s}s")
            time.sleep(0.2)

    def dead(self) -> list[subprocess.Popen]:
        return [p for p in self.processes if p.poll() is not None]

    def all_dead(self) -> bool:
        """Every process exited and none will be restarted (given up, or stopping)."""
        return bool(self.processes) and len(self.dead()) == len(self.processes) and (
            self._stopping or all(life.gave_up for life in self._lives))

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process, then SIGKILL the process groups still alive after ``grace_s``."""
        with self._lock:
            self._stopping = True  # no restarts from here on
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
