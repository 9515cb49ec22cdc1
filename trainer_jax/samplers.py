"""Local sampler processes: ``mixrl-sample`` command lines, started, watched and stopped.

The trainer knows its local samplers only by command line and by what they say over the wire:
nothing here imports the sampler package (or torch). Each process gets its own session and log
file under ``<run>/logs``; external groups (``spawn: false``) join by address on their own.
Own sessions keep a terminal's Ctrl-C from reaching the samplers before the trainer stops them in
order; so that a trainer killed outright (SIGKILL, OOM) leaves no orphans, each sampler is told
the trainer's pid (``--exit-with-parent``) and stops within seconds of its death.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

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
           "--name", f"{group.name}-{index}", "--weights-cache", str(cache_dir)]
    for key in ("attention", "kv_cache_dtype", "logit_noise"):
        if getattr(group, key) is not None:
            cmd += ["--recipe-override", f"{key}={getattr(group, key)}"]
    if exit_with_parent is not None:
        cmd += ["--exit-with-parent", str(exit_with_parent)]
    return cmd


class LocalSamplers:
    """The ``spawn: true`` groups of a run config, as child processes."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.logs = run_dir / "logs"
        self.processes: list[subprocess.Popen] = []

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
                with open(self.logs / f"{g.name}-{i}.log", "ab") as log:
                    self.processes.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                           start_new_session=True))

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
        return bool(self.processes) and len(self.dead()) == len(self.processes)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process, then SIGKILL the process groups still alive after ``grace_s``."""
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
