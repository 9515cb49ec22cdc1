"""The verifiers bridge's behaviour its human-style mutants showed untested (issue 46;
docs/testing.md)."""

from __future__ import annotations

import re

import pytest

from envs.verifiers_env import _reason


def _snake(name: str) -> str:
    """The reference: "vf_" + the error type's words in lower case joined by "_", only
    [a-z0-9_] kept, at most 40 characters (a metric name)."""
    words = re.findall(r"[A-Z]?[^A-Z]*", name)
    text = "_".join(w.lower() for w in words if w)
    return ("vf_" + "".join(c for c in text if c in "abcdefghijklmnopqrstuvwxyz0123456789_"))[:40]


@pytest.mark.parametrize("error_type, expected", [
    ("TimeoutError", "vf_timeout_error"),
    ("OverlongPromptError", "vf_overlong_prompt_error"),
    ("Weird-Type!", "vf_weird_type"),
    ("ARatherLongErrorTypeNameThatGoesOnAndOn", "vf_a_rather_long_error_type_name_that_go"),
])
def test_a_not_ok_episodes_error_type_names_its_error_counter(error_type, expected):
    # The episode's error counter (and its finish_reason) is "vf_" + the verifiers error type in
    # snake case: each type its own counter, never one nameless "vf_" for all of them.
    assert _reason(error_type) == expected == _snake(error_type)
    assert len(_reason(error_type)) <= 40
