"""Environments: single-turn verifiable tasks and a multi-turn tool sandbox, behind one interface."""

from envs import chat_math, dataset, long_tasks, repo, single_turn, tool  # noqa: F401  (registers the environments)
from envs.base import (
    ENVIRONMENTS,
    TERMINATIONS,
    Environment,
    Episode,
    StepResult,
    Task,
)
from envs.loading import make_env

__all__ = ["ENVIRONMENTS", "TERMINATIONS", "Environment", "Episode", "StepResult", "Task", "make_env"]
