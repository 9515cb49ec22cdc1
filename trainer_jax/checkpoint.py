"""Training checkpoints with orbax: parameters, optimizer state and the loop's own state.

A checkpoint at step s holds ``state`` (the model's parameters and the optimizer's state, as
arrays) and ``meta`` (JSON: step, weights version, data cursor, RNG state, router state, the set
of finished task ids, ...). Orbax writes each step to a temp directory and commits it with a
rename, so a run killed mid-save resumes from the previous complete step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from flax import nnx


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, *, keep_last: int = 3):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep_last, create=True),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer, meta: dict[str, Any]) -> None:
        state = {"params": nnx.state(model, nnx.Param), "optimizer": nnx.state(optimizer)}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer, step: int | None = None) -> dict[str, Any]:
        """Load ``step`` (default: latest) into ``model`` and ``optimizer``; return its meta."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = {"params": nnx.state(model, nnx.Param), "optimizer": nnx.state(optimizer)}
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        nnx.update(model, restored.state["params"])
        nnx.update(optimizer, restored.state["optimizer"])
        return dict(restored.meta)

    def close(self) -> None:
        self.manager.close()
