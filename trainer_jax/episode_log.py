"""Episodes as a user inspects them, and the per-step episode metrics.

``EpisodeLog.write`` keeps ``train.log_episodes`` whole episodes of each step in
``episodes/step_<n>.jsonl`` (one JSON object per episode): the prompt, each policy turn with its
text, its tool calls and every token's weight version, each observation, the reward and how the
episode ended. Multi-turn episodes go first (they are what needs reading); text is decoded with
the run's tokenizer, ids are not kept (the trajectory pickle has them, ``MIXRL_SAVE_TRAJECTORIES``).

``episode_metrics`` summarises a step's samples: ``episode/tokens`` (mean and max length),
``episode/turns``, ``episode/versions`` (distinct weight versions per episode: above 1 when an
episode spanned a reload), ``episode/spans_reload`` (share that did), ``episode/version_lag``
(the trainer's version minus an episode's oldest token's, mean and max) and, for tool episodes,
``tool/outcome/<ok|error|timed_out|malformed>`` (shares of tool turns, read from the observation
that answered each), ``tool/calls_per_episode`` and ``tool/episodes_2plus_calls`` (the share of
tool episodes with two or more well-formed calls).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from envs.base import split_finish_reason
from envs.rollout import segments

EPISODES_DIR = "episodes"


def _env_of(group) -> Any:
    private = getattr(group.task, "private", None)
    return private[1] if isinstance(private, tuple) and len(private) == 2 else None


def _whole(group, t) -> tuple[np.ndarray, np.ndarray]:
    """A record's whole episode, prompt first: a ``TrajectoryRecord`` holds the tokens after the
    prompt, and the prompt is the task's (as ``Sample.from_record`` joins them)."""
    prompt = np.asarray(getattr(group.task, "prompt_ids", ()) or (), np.int32)
    mask = np.asarray(t.loss_mask)
    return (np.concatenate([prompt, np.asarray(t.token_ids, np.int32)]),
            np.concatenate([np.zeros(len(prompt), mask.dtype), mask]))


def _parser(env):
    """The environment's tool-call parser (``repo``'s tools or the shell's), or None."""
    if env is None or env.single_turn or getattr(env, "chat", None) is None:
        return None
    if getattr(env, "name", "") == "repo":
        from envs.repo_tools import parse_calls

        return parse_calls
    from envs.tool_calls import parse_tool_calls

    return parse_tool_calls


def _outcome(observation: str, malformed: int, calls: int) -> str:
    if not calls:
        return "malformed" if malformed else ""
    if "[timed out]" in observation:
        return "timed_out"
    # The tools answer a failed call with a line starting "error:" (envs.repo_tools, envs.untrusted).
    return "error" if "error:" in observation else "ok"


def episode_record(group, t, tokenizer, trainer_version: int) -> dict:
    """One trajectory of ``group`` as the log keeps it (see the module docstring)."""
    env = _env_of(group)
    parse = _parser(env)
    token_ids, loss_mask = _whole(group, t)
    termination, errors = split_finish_reason(getattr(t, "finish_reason", "") or "")
    versions = np.asarray(t.versions, np.int64)
    turns: list[dict] = []
    p = 0  # policy-token index into versions
    for a, b, policy in segments(loss_mask):
        text = tokenizer.decode([int(x) for x in token_ids[a:b]], skip_special_tokens=False)
        if not policy:
            turns.append({"role": "prompt" if a == 0 else "observation", "tokens": b - a, "text": text})
            continue
        turn: dict[str, Any] = {"role": "policy", "tokens": b - a, "text": text,
                                "versions": versions[p: p + b - a].tolist()}
        p += b - a
        if parse is not None:
            calls, malformed = parse(text)
            turn["tool_calls"], turn["malformed_calls"] = calls, malformed
        turns.append(turn)
    for i, turn in enumerate(turns):  # each tool turn's outcome, from the observation after it
        if "tool_calls" in turn:
            after = turns[i + 1]["text"] if i + 1 < len(turns) else ""
            turn["outcome"] = _outcome(after, turn["malformed_calls"], len(turn["tool_calls"])) or None
    return {"task_id": int(t.task_id), "sample_index": int(t.sample_index), "group": t.group,
            "sampler": getattr(t, "sampler_name", ""), "env": getattr(env, "name", None),
            "reward": None if t.reward is None else float(t.reward), "termination": termination,
            "errors": errors, "tokens": int(len(token_ids)), "policy_tokens": int(loss_mask.sum()),
            "turns_policy": sum(turn["role"] == "policy" for turn in turns),
            "versions": sorted({int(v) for v in versions}), "trainer_version": int(trainer_version),
            "turns": turns}


def episode_metrics(groups, trainer_version: int) -> dict[str, float]:
    """The step's ``episode/*`` and ``tool/outcome/*`` values (module docstring)."""
    trajectories = [t for g in groups for t in g.trajectories]
    if not trajectories:
        return {}
    tokens = np.asarray([len(_whole(g, t)[0]) for g in groups for t in g.trajectories], np.float64)
    turns = np.asarray([sum(pol for _, _, pol in segments(t.loss_mask)) for t in trajectories], np.float64)
    distinct = np.asarray([len(np.unique(t.versions)) if len(t.versions) else 0 for t in trajectories],
                          np.float64)
    lag = np.asarray([trainer_version - int(np.min(t.versions)) if len(t.versions) else 0
                      for t in trajectories], np.float64)
    values = {"episode/tokens": float(tokens.mean()), "episode/tokens_max": float(tokens.max()),
              "episode/turns": float(turns.mean()), "episode/turns_max": float(turns.max()),
              "episode/versions": float(distinct.mean()), "episode/versions_max": float(distinct.max()),
              "episode/spans_reload": float((distinct > 1).mean()),
              "episode/version_lag": float(lag.mean()), "episode/version_lag_max": float(lag.max())}
    outcomes: Counter = Counter()
    per_episode = []  # well-formed calls per tool episode
    for g in groups:
        env = _env_of(g)
        parse = _parser(env)
        if parse is None:
            continue
        tokenizer = env.tokenizer
        for t in g.trajectories:
            segs = segments(t.loss_mask)
            per_episode.append(0)
            for i, (a, b, policy) in enumerate(segs):
                if not policy:
                    continue
                calls, malformed = parse(tokenizer.decode([int(x) for x in t.token_ids[a:b]],
                                                          skip_special_tokens=False))
                after = ""
                if i + 1 < len(segs):
                    c, d, _ = segs[i + 1]
                    after = tokenizer.decode([int(x) for x in t.token_ids[c:d]], skip_special_tokens=False)
                per_episode[-1] += len(calls)
                if kind := _outcome(after, malformed, len(calls)):
                    outcomes[kind] += 1
    if per_episode:
        calls = np.asarray(per_episode, np.float64)
        values["tool/calls_per_episode"] = float(calls.mean())
        values["tool/episodes_2plus_calls"] = float((calls >= 2).mean())
    total = sum(outcomes.values())
    for kind in ("ok", "error", "timed_out", "malformed"):
        if total:
            values[f"tool/outcome/{kind}"] = outcomes[kind] / total
    return values


class EpisodeLog:
    """``train.log_episodes`` episodes per step to ``<run>/episodes/step_<n>.jsonl`` (0: off)."""

    def __init__(self, run_dir: str | os.PathLike, per_step: int, tokenizer):
        self.dir = Path(run_dir) / EPISODES_DIR
        self.per_step, self.tokenizer = per_step, tokenizer

    def write(self, step: int, groups, trainer_version: int) -> Path | None:
        if self.per_step <= 0:
            return None
        picked = [(g, t) for g in groups for t in g.trajectories]
        # Multi-turn episodes first, then in arrival order.
        picked.sort(key=lambda gt: -int(sum(pol for _, _, pol in segments(gt[1].loss_mask)) > 1))
        picked = picked[: self.per_step]
        if not picked:
            return None
        self.dir.mkdir(exist_ok=True)
        path = self.dir / f"step_{step}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            for g, t in picked:
                record = episode_record(g, t, self.tokenizer, trainer_version)
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        tmp.replace(path)
        return path


def read_episodes(run_dir: str | os.PathLike) -> list[dict]:
    """Every logged episode of a run, with its ``step``, in step order."""
    out = []
    d = Path(run_dir) / EPISODES_DIR
    files = sorted(d.glob("step_*.jsonl"), key=lambda p: int(p.stem.split("_")[1])) if d.is_dir() else []
    for path in files:
        step = int(path.stem.split("_")[1])
        for line in path.read_text().splitlines():
            if line.strip():
                out.append({"step": step, **json.loads(line)})
    return out


__all__ = ["EPISODES_DIR", "EpisodeLog", "episode_metrics", "episode_record", "read_episodes", "segments"]
