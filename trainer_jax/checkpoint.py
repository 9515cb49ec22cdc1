"""Training checkpoints with orbax: parameters, optimizer state and the loop's own state.

A checkpoint at step s holds ``state`` (the model's parameters and the optimizer's state, as
arrays) and ``meta`` (JSON: step, weights version, data cursor, RNG state, router state, the set
of finished task ids, ...).

Crash consistency, in three layers:

- Orbax writes each step into ``<s>.orbax-checkpoint-tmp*`` and commits it with a rename, so a
  process killed mid-save leaves only a temp directory, which is never a step. Opening the
  directory removes such leftovers and says so (``notes``).
- After the commit, ``mixrl_manifest.json`` (size and sha256 of every file of the step) is
  written through a temp name. Restoring verifies it, so a truncated or bit-rotted file is caught
  even where orbax would read it without complaint. A step without one (killed between the two
  renames, or written before manifests existed) is trusted to orbax's own commit.
- ``restore()`` without a step tries the newest step first and falls back step by step; each
  unreadable step gives one line naming it and is moved aside to ``corrupt-<s>`` (kept for
  inspection, out of the way of the resumed run, which will save step numbers past it again).

Manifests are written and checked only in single-process runs: with several processes each host
writes its own shards, which one host cannot list.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from trainer_jax.faults import fault_point

MANIFEST = "mixrl_manifest.json"
_TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one could not be written; the message is one line naming it."""


class _DropOrbaxErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "/orbax/" in record.pathname)


@contextlib.contextmanager
def _orbax_errors_raised_not_logged():
    """Orbax logs a failed save with its whole traceback before raising it; the failure reaches
    the user once, as ``CheckpointError``'s line, so the log copy is dropped while saving."""
    absl = logging.getLogger("absl")
    quiet = _DropOrbaxErrors()
    absl.addFilter(quiet)
    try:
        yield
    finally:
        absl.removeFilter(quiet)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(step_dir: Path) -> None:
    """Record size and sha256 of every file of a committed step (temp name, then rename)."""
    files = {str(p.relative_to(step_dir)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(step_dir)}
    tmp = step_dir / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"files": files}, indent=1) + "\n")
    os.replace(tmp, step_dir / MANIFEST)


def verify_manifest(step_dir: Path) -> str | None:
    """What is wrong with ``step_dir`` against its manifest, or ``None`` (also without one)."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} unreadable ({e})"
    for rel, want in files.items():
        p = step_dir / rel
        if not p.is_file():
            return f"{rel} is missing"
        if (size := p.stat().st_size) != want["size"]:
            return (f"{rel} has {size} bytes, expected {want['size']}"
                    + (" (truncated)" if size < want["size"] else ""))
        if _sha256(p) != want["sha256"]:
            return f"{rel} does not match its sha256"
    return None


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, *, keep_last: int = 3,
                 log: Callable[[str], None] | None = None):
        self.directory = Path(directory).absolute()
        self.keep_last = keep_last
        self.log = log or (lambda line: None)
        #: one line per leftover found on opening or step skipped on restore
        self.notes: list[str] = []
        self._single = jax.process_count() == 1
        if self._single and self.directory.is_dir():
            for p in sorted(self.directory.iterdir()):
                if _TMP_MARK in p.name:
                    self._note(f"interrupted checkpoint {p} (never committed) removed")
                    shutil.rmtree(p, ignore_errors=True)
        self.manager = self._open()

    def _open(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=self.keep_last, create=True,
                                                 cleanup_tmp_directories=True),
            item_names=("state", "meta"))

    def _note(self, line: str) -> None:
        self.notes.append(line)
        self.log(line)

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer, meta: dict[str, Any]) -> None:
        """Write step ``step``; raise ``CheckpointError`` (one line) if it cannot be written."""
        state = {"params": nnx.state(model, nnx.Param), "optimizer": nnx.state(optimizer)}
        try:
            with _orbax_errors_raised_not_logged():
                self.manager.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
                fault_point("checkpoint")  # tests: the commit is in flight in orbax's thread here
                self.manager.wait_until_finished()
            if self._single:
                write_manifest(self.step_dir(step))
        except (OSError, ValueError, RuntimeError) as e:
            if self._single:
                self._clear_failed(step)
            raise CheckpointError(f"checkpoint step {step} in {self.directory} could not be written: "
                                  f"{_one_line(e)}") from e

    def _clear_failed(self, step: int) -> None:
        """Remove what orbax left of a failed save: never a checkpoint, and it should not look like
        one. Orbax's other writes of the step may still be landing, so look again a few times."""
        with contextlib.suppress(Exception):
            self.manager.wait_until_finished()
        for _ in range(10):
            left = list(self.directory.glob(f"{step}{_TMP_MARK}*"))
            if not left:
                return
            for p in left:
                shutil.rmtree(p, ignore_errors=True)
            time.sleep(0.2)

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer, step: int | None = None) -> dict[str, Any]:
        """Load ``step`` (default: the newest readable one) into ``model`` and ``optimizer``; return
        its meta. Without ``step``, unreadable newer steps are reported and moved aside."""
        if step is not None:
            return self._restore_step(model, optimizer, step)
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        for s in steps:
            try:
                return self._restore_step(model, optimizer, s)
            except CheckpointError as e:
                if not self._single:
                    raise  # other hosts cannot be told to skip the same step; stop instead
                aside = self.directory / f"corrupt-{s}"
                n = 1
                while aside.exists():
                    n += 1
                    aside = self.directory / f"corrupt-{s}-{n}"
                os.replace(self.step_dir(s), aside)
                self._note(f"{e}; moved to {aside.name}, trying the previous one")
                self.manager = self._open()  # forget the step moved aside
        raise CheckpointError(f"no readable checkpoint in {self.directory} (tried steps "
                              f"{', '.join(map(str, steps))})")

    def _restore_step(self, model: nnx.Module, optimizer: nnx.Optimizer, step: int) -> dict[str, Any]:
        where = self.step_dir(step)
        if self._single and (problem := verify_manifest(where)):
            raise CheckpointError(f"checkpoint {where} is corrupt: {problem}")
        target = {"params": nnx.state(model, nnx.Param), "optimizer": nnx.state(optimizer)}
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
            meta = dict(restored.meta)
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds; one line each
            raise CheckpointError(f"checkpoint {where} is unreadable: {_one_line(e)}") from e
        # Only a fully read step reaches the model: a failure above leaves it untouched.
        nnx.update(model, restored.state["params"])
        nnx.update(optimizer, restored.state["optimizer"])
        return meta

    def close(self) -> None:
        self.manager.close()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if len(text) > 400:  # tensorstore's messages end with the OS error: keep both ends
        text = f"{text[:200]} ... {text[-200:]}"
    return f"{type(e).__name__}: {text}"
