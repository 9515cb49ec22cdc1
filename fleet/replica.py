"""One fleet replica: fetch the trainer's current weights, then run ``mixrl-sample`` as a child.

On Ray this class is the replica actor (``fleet.controller`` wraps it with ``ray.remote``): the
sampler runs as a child process of the actor's worker with ``--exit-with-parent <worker pid>``
(``sampler_torch.parent_watch``: PDEATHSIG plus a watchdog), so a killed actor, a dead worker or a
lost node takes its sampler with it. The sampler is a child, not a call in the worker, because its
orderly stop is a signal handler (main thread only) and because a crash in the engine must not take
the actor's reporting with it. ``state()`` answers while the start is under way (the actor runs
with ``max_concurrency`` > 1).

``--device auto`` in the child: Ray sets ``CUDA_VISIBLE_DEVICES`` for an actor with ``num_gpus``;
the child inherits it, without launcher ranks or a trainer's spawn slot (``replica_env``), so
``auto`` is the first (the only) GPU Ray gave this replica.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from mixrl_wire.devices import LAUNCHER_RANK_ENV, SPAWN_SLOT_ENV
from sampler_torch.parent_watch import pid_alive


def replica_env(env: Mapping[str, str]) -> dict[str, str]:
    """The sampler child's environment: ``env`` (with the ``CUDA_VISIBLE_DEVICES`` Ray set) minus
    launcher ranks and a spawn slot, which would make ``--device auto`` pick another GPU."""
    return {k: v for k, v in env.items() if k not in LAUNCHER_RANK_ENV and k != SPAWN_SLOT_ENV}


def sampler_command(python: str, trainer: str, sampler_args: Sequence[str], *, model_dir: Path,
                    token_file: Path, name: str, cache: Path, transfer: str, parent: int) -> list[str]:
    """The child's command line: the group's ``mixrl-sample`` arguments plus this replica's."""
    return [python, "-m", "sampler_torch.cli", "--trainer", trainer, *sampler_args,
            "--model-dir", str(model_dir), "--token-file", str(token_file), "--name", name,
            "--weights-cache", str(cache), "--weights-transfer", transfer,
            "--exit-with-parent", str(parent)]


class Replica:
    """A replica's life: ``starting`` (fetching weights), ``running`` (the sampler child is alive),
    ``dead`` (the child exited or the fetch failed; ``detail`` says why)."""

    def __init__(self, name: str, group: str, trainer: str, token: str, sampler_args: Sequence[str], *,
                 python: str, transfer: str = "auto", fleet: str = "mixrl", fetch_timeout_s: float = 300.0):
        from fleet.spec import python as default_python

        self.name, self.group, self.trainer = name, group, trainer
        self.sampler_args = list(sampler_args)
        self.python = python or default_python()
        self.transfer, self.fetch_timeout_s = transfer, fetch_timeout_s
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{fleet}/{name}")
        root = Path(tempfile.gettempdir()) / "mixrl-fleet"
        root.mkdir(parents=True, exist_ok=True)
        # One directory per actor, never reused: a dead namesake's files are never this one's.
        self.dir = Path(tempfile.mkdtemp(prefix=f"{safe}-", dir=root))
        (self.dir / "pid").write_text(str(os.getpid()))
        remove_stale(root, keep=self.dir)
        self.token_file = self.dir / "token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        self._token = token
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.state_, self.detail, self.version = "starting", "fetching the current weights", -1
        self.started = time.time()
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        """Begin (fetch, then start the sampler) in the background; returns the replica's name."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mixrl-replica", daemon=True)
                self._thread.start()
        return self.name

    def _run(self) -> None:
        from fleet.weights import FetchError, fetch_current

        recipe = self.sampler_args[self.sampler_args.index("--recipe") + 1]
        try:
            version, path = fetch_current(self.trainer, self._token, group=self.group, recipe=recipe,
                                          name=self.name, cache_dir=self.dir / "initial",
                                          transfer=self.transfer, timeout_s=self.fetch_timeout_s,
                                          stop=self._stop)
        except FetchError as e:
            with self._lock:
                self.state_, self.detail = "dead", f"weights: {e}"
            if self._stop.is_set():
                shutil.rmtree(self.dir, ignore_errors=True)  # what the fetch wrote after stop()'s removal
            return
        cmd = sampler_command(self.python, self.trainer, self.sampler_args, model_dir=path,
                              token_file=self.token_file, name=self.name, cache=self.dir / "cache",
                              transfer=self.transfer, parent=os.getpid())
        with self._lock:
            if self._stop.is_set():  # stopped during the fetch: its removal may predate the download
                shutil.rmtree(self.dir, ignore_errors=True)
                return
            log = open(self.dir / "sampler.log", "ab")
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=replica_env(os.environ), start_new_session=True)
            log.close()
            self.version, self.state_, self.detail = version, "running", f"from version {version}"
        # This thread forked the child and stays until the child exits: PR_SET_PDEATHSIG fires on
        # the death of the forking *thread*, which must not be a thread that ends early.
        self.proc.wait()

    def state(self) -> dict:
        """Where this replica stands, as plain data for the controller and ``mixrl-fleet status``."""
        with self._lock:
            if self.proc is not None and self.state_ == "running" and self.proc.poll() is not None:
                self.state_ = "dead"
                self.detail = (f"the sampler exited with code {self.proc.returncode} "
                               f"(log {self.dir}/sampler.log)")
            return {"name": self.name, "group": self.group, "state": self.state_, "detail": self.detail,
                    "version": self.version, "pid": os.getpid(),
                    "sampler_pid": self.proc.pid if self.proc is not None else None,
                    "node": _node_id(), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                    "started": self.started}

    def stop(self, grace_s: float = 20.0) -> int | None:
        """Stop the sampler in order (SIGTERM, then SIGKILL after ``grace_s``); its exit code."""
        self._stop.set()
        with self._lock:
            proc = self.proc
        code = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        with self._lock:
            self.state_, self.detail = "dead", "stopped"
        shutil.rmtree(self.dir, ignore_errors=True)
        return code


def remove_stale(root: Path, keep: Path) -> list[Path]:
    """Remove the directories (token, initial weights, cache) of replicas on this node whose
    actor process is gone: a SIGKILLed or lost actor never ran its ``stop``. Returns them. A
    directory without a readable pid yet (a replica starting) is left alone."""
    gone = []
    for d in root.iterdir() if root.is_dir() else []:
        try:
            pid = int((d / "pid").read_text())
        except (OSError, ValueError):
            continue
        if d != keep and not pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def _node_id() -> str:
    """The Ray node this replica is on ("" outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - a status field, never worth failing the call
        return ""
