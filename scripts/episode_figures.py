#!/usr/bin/env python
"""The episode figures of a finished run (docs/operations.md, "Long agentic episodes"), from its
metrics.jsonl (trainer_jax.episode_log's episode/* and tool/* values, averaged over the steps):

    .venv/bin/python scripts/episode_figures.py runs/local_agentic
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def figures(run_dir: str | Path) -> str:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0 and "loss" in r]
    if not steps:
        raise SystemExit(f"{run_dir}: no trained steps in metrics.jsonl")

    def mean(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in steps)

    def top(key: str) -> float:
        return max(r.get(key, 0.0) for r in steps)

    m, t = mean, top
    parts = [f"steps {len(steps)}",
             f"tokens per episode {m('episode/tokens'):.0f} (max {t('episode/tokens_max'):.0f})",
             f"policy turns {m('episode/turns'):.2f}",
             f"well-formed tool calls per episode {m('tool/calls_per_episode'):.2f}, >= 2 in "
             f"{m('tool/episodes_2plus_calls'):.0%} of episodes",
             f"call rate {m('tool/call_rate'):.2f}",
             f"tool turns ok / error / malformed {m('tool/outcome/ok'):.2f} / "
             f"{m('tool/outcome/error'):.2f} / "
             f"{m('tool/outcome/malformed'):.2f}",
             f"weight versions per episode {m('episode/versions'):.2f} "
             f"(max {t('episode/versions_max'):.0f}), "
             f"{m('episode/spans_reload'):.0%} span a reload",
             f"version lag {m('episode/version_lag'):.2f} (max {t('episode/version_lag_max'):.0f})",
             f"reward {steps[0]['reward_mean']:.3f} -> {steps[-1]['reward_mean']:.3f}"]
    return "; ".join(parts)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: episode_figures.py RUN_DIR")
    print(figures(sys.argv[1]))
