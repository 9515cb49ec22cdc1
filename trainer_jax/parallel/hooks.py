"""The two places where the model and the objective let a device mesh in.

The single-device code paths (``trainer_jax.models.qwen3``, ``trainer_jax.objective.loss``) call
``constrain`` on a few activations and ask ``override`` for the operations whose sharded
version is not what the SPMD partitioner would derive by itself (the MoE dispatch, attention's
kernels, the vocabulary-parallel log-sum-exp, the placement of the remat scan's stacked layer
states, the embedding table's gradient). Both are no-ops unless a ``ParallelContext`` is active,
which ``trainer_jax.parallel`` enters *inside* the functions it jits, so the hooks affect only the
traces of sharded steps and single-device programs are unchanged.

This module imports nothing from the project (the model imports it).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax


class Hooks(Protocol):
    """What an active parallel context provides (see ``trainer_jax.parallel.context``)."""

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array: ...

    def override(self, name: str) -> Callable[..., Any] | None: ...


_ACTIVE: contextvars.ContextVar[Hooks | None] = contextvars.ContextVar("mixrl_parallel_hooks",
                                                                       default=None)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Pin ``x``'s sharding to the mesh axes its logical axes map to; identity without a mesh."""
    hooks = _ACTIVE.get()
    return x if hooks is None else hooks.constrain(x, logical_axes)


def override(name: str) -> Callable[..., Any] | None:
    """The active context's replacement for operation ``name`` (``"moe"``, ``"lse_and_logits_at"``,
    ``"layer_stack"``, ``"embed"``, ``"attention"``; with a ``context`` axis also
    ``"sequence_layout"`` and ``"token_gather"``, ``parallel/sequence.py``)."""
    hooks = _ACTIVE.get()
    return None if hooks is None else hooks.override(name)


@contextlib.contextmanager
def use(hooks: Hooks | None) -> Iterator[None]:
    """Make ``hooks`` active in this thread for the duration (``None``: deactivate)."""
    token = _ACTIVE.set(hooks)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> Hooks | None:
    return _ACTIVE.get()
