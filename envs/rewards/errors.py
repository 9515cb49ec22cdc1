"""A reward's own reason for scoring 0, named so that it can be counted.

A reward function that raises ``RewardError(reason, message)`` scores 0 like any exception; its
``reason`` (a short metric name: ``unsupported_test``, ``non_plain_value``, ...) says which way it
failed. Subclasses ValueError: callers that catch a bad row's ValueError catch it too.
"""

from __future__ import annotations

import re

_REASON = re.compile(r"[a-z][a-z0-9_]{0,39}")


class RewardError(ValueError):
    """Why a reward scored 0, as ``reason`` (``[a-z][a-z0-9_]*``, at most 40 characters)."""

    def __init__(self, reason: str, message: str):
        if not _REASON.fullmatch(reason):
            raise ValueError(f"a reward error's reason must match {_REASON.pattern}, got {reason!r}")
        super().__init__(f"{reason}: {message}")
        self.reason = reason


__all__ = ["RewardError"]
