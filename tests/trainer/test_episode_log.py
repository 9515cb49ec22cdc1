"""Episode logs and episode metrics (trainer_jax.episode_log), the tool-call alarm and the plots,
on episodes the ``repo`` environment really produced (its scripted demonstration, as the sampler
would record it: policy tokens at weight versions that change between turns)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from shipped_setup import make_tokenizer_dir

from convert.tokenizer import load_tokenizer
from envs import make_env
from trainer_jax.diagnostics import CollapseAlarms, plot_run
from trainer_jax.episode_log import EpisodeLog, episode_metrics, read_episodes, segments


@pytest.fixture(scope="module")
def repo_env(tmp_path_factory):
    env = make_env("repo", load_tokenizer(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))
    env.chat_template_kwargs = {"enable_thinking": False}
    return env


def _trajectory(env, seed: int, *, versions_by_turn, reward: float, task_id: int = 0):
    task = env.sample_task(np.random.default_rng(seed), f"t{seed}")
    ids, mask = env.demonstration(task)
    # A record holds the tokens after the prompt; the task spec holds the prompt.
    prompt = env.prompt(task)
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    ids, mask = np.asarray(ids[len(prompt):], np.int32), np.asarray(mask[len(prompt):], np.uint8)
    versions = []
    for i, (a, b, _policy) in enumerate([s for s in segments(mask) if s[2]]):
        versions += [versions_by_turn[min(i, len(versions_by_turn) - 1)]] * (b - a)
    t = SimpleNamespace(task_id=task_id, sample_index=seed, token_ids=ids, loss_mask=mask,
                        versions=np.asarray(versions, np.int32), reward=reward, group="bf16",
                        sampler_name="s0", finish_reason="submitted;special_tokens")
    spec = SimpleNamespace(private=(task, env), prompt_ids=tuple(prompt))
    return SimpleNamespace(task=spec, trajectories=[t]), task


def test_episode_metrics_count_versions_lag_turns_and_tool_outcomes(repo_env):
    spans, _ = _trajectory(repo_env, 0, versions_by_turn=[3, 3, 4, 5, 5], reward=1.0)
    still, _ = _trajectory(repo_env, 1, versions_by_turn=[5], reward=0.5)
    m = episode_metrics([spans, still], trainer_version=6)
    assert m["episode/versions"] == 2.0 and m["episode/versions_max"] == 3.0  # (3 + 1) / 2
    assert m["episode/spans_reload"] == 0.5
    assert m["episode/version_lag"] == 2.0 and m["episode/version_lag_max"] == 3.0  # 6-3, 6-5
    assert m["episode/turns"] == 5.0 and m["episode/tokens"] > 1500  # the prompt counts
    # Every demonstrated call succeeds; the final submit has no observation after it.
    assert m["tool/outcome/ok"] == 1.0 and m["tool/calls_per_episode"] == 5.0
    assert m["tool/episodes_2plus_calls"] == 1.0


def test_episode_log_writes_whole_episodes_and_plots_draw_them(repo_env, tmp_path):
    spans, task = _trajectory(repo_env, 2, versions_by_turn=[7, 8, 8, 8, 9], reward=1.0)
    log = EpisodeLog(tmp_path, 4, repo_env.tokenizer)
    path = log.write(3, [spans], trainer_version=9)
    assert path == tmp_path / "episodes" / "step_3.jsonl"
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert record["versions"] == [7, 8, 9] and record["reward"] == 1.0
    assert record["termination"] == "submitted" and record["errors"] == {"special_tokens": 1}
    roles = [t["role"] for t in record["turns"]]
    assert roles[0] == "prompt" and roles.count("policy") == 5 and roles.count("observation") == 4
    policy = [t for t in record["turns"] if t["role"] == "policy"]
    assert [c["name"] for t in policy for c in t["tool_calls"]] == [
        "run_tests", "read_file", "replace", "run_tests", "submit"]
    assert policy[0]["versions"] == [7] * policy[0]["tokens"] and policy[-1]["versions"][-1] == 9
    observations = [t["text"] for t in record["turns"] if t["role"] == "observation"]
    assert "FAIL tests/" in observations[0] and "tests pass" in observations[-1]
    assert task.payload["package"] in record["turns"][0]["text"] and record["tokens"] > 1500
    assert record["turns"][0]["tokens"] == len(spans.task.prompt_ids)
    assert read_episodes(tmp_path)[0]["step"] == 3
    assert EpisodeLog(tmp_path / "off", 0, repo_env.tokenizer).write(1, [spans], 9) is None

    # The plots: episode length, turns, tool-call outcomes and version lag from the metrics.
    rows = [{"step": s, **episode_metrics([spans], trainer_version=9 + s), "tool/call_rate": 1.0}
            for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = {p.name for p in plot_run(tmp_path)}
    assert {"episode_length.png", "episode_turns.png", "tool_outcomes.png", "version_lag.png"} <= names


def test_tool_call_alarm_raises_when_the_call_rate_falls_and_clears():
    alarms = CollapseAlarms(window=3)
    seen = []
    for rate in [0.9, 0.9, 0.9, 0.9, 0.8, 0.3, 0.1, 0.1, 0.9, 0.9, 0.9]:
        seen.append(any("tool calls falling" in a for a in alarms.update(None, None, None, call_rate=rate)))
    assert seen[:5] == [False] * 5 and seen[6] and seen[7] and not seen[-1]
    assert CollapseAlarms().update(0.5, None, None) == []  # no call rate (no tool env): no alarm


def test_the_task_source_reports_the_repo_tools_call_rate(repo_env):
    # tool/call_rate comes from the environment's own tool parser (repo's tools are not the
    # shell's): every demonstrated turn calls a tool; a reply without a call lowers the rate.
    from trainer_jax.config.run import MixEntry
    from trainer_jax.service.tasks import EnvTaskSource

    source = EnvTaskSource([MixEntry(env="repo")], tokenizer=repo_env.tokenizer)
    group, _ = _trajectory(repo_env, 5, versions_by_turn=[0], reward=1.0)
    group.task.env = "repo"
    assert source.metrics([group])["tool/call_rate"] == 1.0
    t = group.trajectories[0]
    a, b, _ = [s for s in segments(t.loss_mask) if s[2]][0]
    words = repo_env.chat.encode("I would rather not.")[: b - a - 1]
    t.token_ids[a:b] = np.asarray(words + [repo_env.chat.encode(" ")[0]] * (b - a - 1 - len(words))
                                  + [repo_env.chat.stop_ids[0]], np.int32)
    m = source.metrics([group])
    assert m["tool/call_rate"] == 0.8 and m["tool/toolless"] == 0.2
    assert episode_metrics([group], 0)["tool/calls_per_episode"] == 4.0
