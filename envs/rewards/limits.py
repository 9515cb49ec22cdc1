"""The reward pool's protocol limits, shared by the pool, its worker and the rewards that run in a
call (a module of its own so that none of them imports the package back)."""

from __future__ import annotations

#: At most this many metrics beside ``reward`` in one answer (``envs.rewards.worker`` enforces it).
MAX_METRICS = 32
#: A request line (its newline aside) of at most this many bytes reaches a worker: the pool scores
#: a longer one 0 (``too_large``) without sending it, and a worker answers one ``too_large`` unread.
MAX_REQUEST_BYTES = 64 * 1024**2
#: Where a call's process finds its deadline (``time.time()`` seconds): rewards that start a
#: sandbox fit it inside their own timeout (``envs.rewards.code_harness``).
DEADLINE_ENV = "MIXRL_REWARD_DEADLINE"

__all__ = ["DEADLINE_ENV", "MAX_METRICS", "MAX_REQUEST_BYTES"]
