"""Values in range on the service side (issue 44, item 4): a ``Submit`` / ``SubmitStream`` whose
reward or reward part is not finite or beyond ``service.limits.max_abs_reward`` (default 1e6) is
refused as ``out_of_range``, naming the field, and counted; values at the limit, negative zero
and subnormals pass. Over real gRPC on 127.0.0.1."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from fakes import fake_trajectory
from test_service import client, lease_all, make_service

from trainer_jax.config import ConfigError, load_config

BAD_REWARDS = [1e308, 3e38, -3e38, float("inf"), float("-inf"), float("nan"), 1.5e6, -1000001.0]
BAD_PARTS = [("p", float("inf")), ("p", 3e38), ("p", -2e6), ("p", float("nan"))]
GOOD_REWARDS = [1e6, -1e6, -0.0, 1e-45, 0.0, 1.0]  # 1e-45: a float32 subnormal; 1e6 is exact


@pytest.fixture
def svc():
    s = make_service("tasks.count=1000")
    yield s
    s.stop(grace=0)


def _trajectories(svc, c, n: int, rng) -> list:
    tasks = lease_all(c, n, tries=20)
    trajs = [fake_trajectory(t, i, svc.vocab_size, rng) for t in tasks for i in t.sample_indices]
    assert len(trajs) >= n
    return trajs[:n]


def _with(traj, reward=None, parts=()):
    if reward is not None:
        traj.reward = reward
    for name, value in parts:
        traj.reward_parts.add(name=name, value=value)
    return traj


def test_submit_and_stream_refuse_rewards_out_of_range(svc):
    rng = np.random.default_rng(0)
    c = client(svc, capacity=64)
    n_bad = len(BAD_REWARDS) + len(BAD_PARTS)
    trajs = _trajectories(svc, c, 2 * n_bad + 2 * len(GOOD_REWARDS), rng)
    bad = ([_with(t, reward=r) for t, r in zip(trajs, BAD_REWARDS, strict=False)]
           + [_with(t, parts=[p]) for t, p in zip(trajs[len(BAD_REWARDS):], BAD_PARTS, strict=False)])
    unary = [c.submit(t) for t in bad]  # Submit
    stream_bad = [_with(t, reward=r) for t, r in zip(trajs[n_bad:], BAD_REWARDS, strict=False)] + \
        [_with(t, parts=[p]) for t, p in zip(trajs[n_bad + len(BAD_REWARDS):], BAD_PARTS, strict=False)]
    streamed = c.submit_many(stream_bad)  # SubmitStream
    for results in (unary, streamed):
        assert len(results) == n_bad
        for r, value in zip(results, [*BAD_REWARDS, *(v for _, v in BAD_PARTS)], strict=True):
            assert r.code == grpc.StatusCode.INVALID_ARGUMENT and "out_of_range" in r.reason, (value, r)
        assert all(r.reason.startswith("reward: ") for r in results[:len(BAD_REWARDS)])
        assert all(r.reason.startswith("reward_parts: ") for r in results[len(BAD_REWARDS):])
    # What crossed the wire is float32: 1e308 arrives as inf, 3e38 as itself (finite in float32).
    assert "is inf" in unary[0].reason and "is 3e+38" in unary[1].reason
    rest = trajs[2 * n_bad:]
    good = [_with(t, reward=r, parts=[("p", r)]) for t, r in zip(rest, GOOD_REWARDS * 2, strict=True)]
    ok = [c.submit(t) for t in good[:len(GOOD_REWARDS)]] + c.submit_many(good[len(GOOD_REWARDS):])
    assert all(r.accepted for r in ok), [r.reason for r in ok if not r.accepted]
    s = svc.status()
    mine = [x for x in s["samplers"] if x["name"] == c.name][0]
    assert mine["rejected"] == 2 * n_bad and s["totals"]["rejected"] == 2 * n_bad
    assert mine["rejections"] == {"reward": 2 * len(BAD_REWARDS), "reward_parts": 2 * len(BAD_PARTS)}
    assert mine["accepted"] == len(good)
    # Parts kept as sent: -0.0 keeps its sign, the subnormal survives float32.
    kept = [t for g in svc.buffer.take_groups(100, timeout=0) for t in g.trajectories]
    parts = sorted(t.reward_parts["p"] for t in kept)
    assert parts[0] == -1e6 and parts[-1] == 1e6 and any(p == 0 and math.copysign(1, p) < 0 for p in parts)
    assert any(0 < p < 1e-44 for p in parts)


def test_the_limit_comes_from_the_config():
    svc = make_service("service.limits.max_abs_reward=10", "tasks.count=100")
    try:
        _limit_of_ten(svc)
    finally:
        svc.stop(grace=0)


def _limit_of_ten(svc):
    c = client(svc, capacity=8)
    trajs = _trajectories(svc, c, 4, np.random.default_rng(1))
    results = [c.submit(_with(trajs[0], reward=10.0)), c.submit(_with(trajs[1], reward=-10.5)),
               c.submit(_with(trajs[2], parts=[("x", 11.0)])), c.submit(_with(trajs[3], reward=-10.0))]
    assert [r.accepted for r in results] == [True, False, False, True]
    assert "at most 10 in magnitude (service.limits.max_abs_reward)" in results[1].reason


@pytest.mark.parametrize("value", ["0", "-1", ".inf", ".nan", "'x'", "1e16"])
def test_max_abs_reward_must_be_a_positive_finite_number(value):
    with pytest.raises(ConfigError, match="service.limits.max_abs_reward"):
        load_config(None, [f"service.limits.max_abs_reward={value}"])
    assert load_config(None, []).service.limits.max_abs_reward == 1e6


def test_the_reward_pool_takes_the_services_limit(tmp_path, monkeypatch):
    """``service.limits.max_abs_reward`` reaches the reward pool of a dataset environment (built by
    the environment with the pool's default): a row whose reward function returns 7 under a
    limit of 5 scores 0 as reward/errors/out_of_range, one that returns -5 keeps its reward."""
    import json
    from pathlib import Path

    from convert.tokenizer import char_tokenizer
    from trainer_jax.config import MixEntry
    from trainer_jax.service import RolloutService
    from trainer_jax.service.tasks import EnvTaskSource

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "envs"))  # user_rewards, for workers
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"q": f"{i}?", "a": "x", "value": v}) + "\n"
                            for i, v in enumerate([7.0, -5.0])))
    options = {"path": str(rows), "prompt_key": "q", "answer_key": "a",
               "reward": "user_rewards:returns_value", "reward_workers": 1, "reward_timeout_s": 20}
    source = EnvTaskSource([MixEntry(env="dataset", options=options)], group_size=2,
                           tokenizer=char_tokenizer(), count=2)
    assert source.envs[0].reward.max_abs_reward == 1e6  # what the environment built
    cfg = load_config(None, ["service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.head_k=4",
                             "tasks.sampling.max_new_tokens=8", "service.limits.max_abs_reward=5"])
    svc = RolloutService.from_config(cfg, token="t0ken", source=source).start()
    try:
        from sampler_torch.client import RolloutClient

        c = RolloutClient(svc.address, "t0ken", group="g", capacity=4, name="pool", max_retry_s=10.0)
        rng = np.random.default_rng(2)
        trajs = [fake_trajectory(t, i, svc.vocab_size, rng) for t in lease_all(c, 4)
                 for i in t.sample_indices]
        assert all(r.accepted for r in c.submit_many(trajs))
        groups = sorted(svc.buffer.take_groups(2, timeout=60), key=lambda g: g.task_id)
        assert [g.rewards for g in groups] == [[0.0, 0.0], [-5.0, -5.0]]
        values = source.metrics(groups)
        assert values["reward/errors/out_of_range"] == 2.0 and values["reward_errors"] == 2.0
        assert source.envs[0].reward.max_abs_reward == 5.0
    finally:
        svc.stop(grace=0)
        source.close()
