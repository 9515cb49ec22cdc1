"""A reward worker process: ``python -m envs.rewards.worker``.

Reads one JSON request per line on stdin (``{"fn": "package.module:function", "kwargs": {...}}``)
and answers one JSON line (``{"ok": true, "value": ...}`` or ``{"ok": false, "error": "..."}``).
The answers go to a private copy of the original stdout: whatever the user's function prints
lands on stderr and cannot corrupt the protocol. Imports only what the reward imports (never
torch on our account); the parent kills and replaces a worker that overruns its timeout.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from collections.abc import Callable

from envs.rewards.builtin import BUILTINS


def resolve(spec: str) -> Callable:
    """The function a reward spec names: a built-in name or ``package.module:function``."""
    target = BUILTINS.get(spec, spec)
    module_name, _, attr = target.partition(":")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name} has no function {attr!r}")
    return fn


def normalise(value) -> dict:
    """``{"reward": float, "metrics": {name: float}}`` from a float or a dict with ``reward``."""
    metrics = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"reward function returned a dict without 'reward' (keys {sorted(value)})")
        metrics = {str(k): float(v) for k, v in value.items()
                   if k != "reward" and isinstance(v, int | float) and not isinstance(v, bool)}
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"reward function returned {type(value).__name__}, not a float")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward function returned {reward}")
    return {"reward": reward, "metrics": {k: v for k, v in metrics.items() if math.isfinite(v)}}


def main() -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    functions: dict[str, Callable] = {}
    for line in sys.stdin:
        try:
            request = json.loads(line)
            if "check" in request:  # load the function only (RewardPool.check)
                functions[request["check"]] = resolve(request["check"])
                out.write(json.dumps({"ok": True, "value": None}) + "\n")
                continue
            spec = request["fn"]
            if spec not in functions:
                functions[spec] = resolve(spec)
            answer = {"ok": True, "value": normalise(functions[spec](**request.get("kwargs", {})))}
        except Exception as e:  # noqa: BLE001 - any failure of the user's code is a scored 0
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        out.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
