"""``Trajectory.reward_parts``: a reward's named components (a verifiers rubric's reward functions).

They become metric names on the trainer (``env/<entry>/reward/<name>``), so the wire keeps them
few, plainly named and finite. The trainer refuses a trajectory that breaks these rules
(``trainer_jax.service.validation``); a sampler cleans what an environment reported before it
sends it (``clean``), so a reward function with an odd name costs its metric, never the sample.
No protobuf here: environments import it without the generated code.
"""

from __future__ import annotations

import math
import re
from typing import Any

MAX_PARTS = 16
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,48}")


def clean(value: Any) -> dict[str, float]:
    """The well-formed parts of ``value`` (a mapping name -> number), at most ``MAX_PARTS``;
    anything else is dropped."""
    if not isinstance(value, dict):
        return {}
    out: dict[str, float] = {}
    for name, v in value.items():
        if len(out) == MAX_PARTS:
            break
        if (isinstance(name, str) and NAME.fullmatch(name) and type(v) in (int, float, bool)
                and math.isfinite(float(v))):
            out[name] = float(v)
    return out
