"""Non-finite advantages are counted under a reason of their own and alarmed once, naming the
group (issue 44, item 4): ``batching.non_finite_advantages`` on the trainer's own
``compute_advantages`` against an independent float32 GRPO in numpy, and
``diagnostics.AdvantageAlarm``'s share of tokens against a hand count."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from trainer_jax.batching import non_finite_advantages
from trainer_jax.diagnostics import AdvantageAlarm
from trainer_jax.objective import compute_advantages

INF = float("inf")
# (rewards of one prompt group, whether float32 GRPO breaks on it)
CASES = [
    ([1.0, 0.0], False),
    ([1e6, -1e6], False),           # the service's limit: fine
    ([3e38, 3e38], True),           # the sum overflows: mean inf, then inf - inf
    ([INF, 0.0], True),             # 1e308 as float32
    ([float("nan"), 1.0], True),
    ([-3e38, -3e38], True),
    ([0.0, 0.0], False),            # equal rewards: A = 0, not 0 / 0
    ([1e-45, 0.0], False),          # a subnormal
]


def _numpy_grpo(rewards: np.ndarray, dtype=np.float32, eps: float = 1e-6) -> np.ndarray:
    """GRPO in numpy at ``dtype``, written from the formula (population std), not from the trainer."""
    r = rewards.astype(dtype)
    with np.errstate(all="ignore"):
        mean = r.sum(axis=1, keepdims=True, dtype=dtype) / dtype(r.shape[1])
        dev = r - mean
        std = np.sqrt((dev * dev).sum(axis=1, keepdims=True, dtype=dtype) / dtype(r.shape[1]))
        return dev / (std + dtype(eps))


def test_non_finite_groups_match_an_independent_float32_grpo():
    rewards = np.asarray([r for r, _ in CASES], np.float64)
    adv = np.asarray(compute_advantages(rewards.astype(np.float32), "grpo"))
    flagged = non_finite_advantages(adv)
    assert flagged.tolist() == (~np.isfinite(_numpy_grpo(rewards)).all(axis=1)).tolist()
    assert flagged.tolist() == [broken for _, broken in CASES]
    # In float64 every finite-reward group is fine: the float32 training path is what breaks.
    assert np.isfinite(_numpy_grpo(rewards[[0, 1, 2, 5, 6, 7]], np.float64)).all()
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        non_finite_advantages(adv.ravel())


def _group(task_id: int, rewards: list[float], tokens: list[int], sampler: str = "fp8"):
    return SimpleNamespace(task_id=task_id, trajectories=[
        SimpleNamespace(reward=r, loss_mask=np.r_[np.zeros(3, np.uint8), np.ones(n, np.uint8)],
                        group=sampler) for r, n in zip(rewards, tokens, strict=True)])


def test_the_alarm_names_the_group_once_and_the_share_counts_its_tokens():
    alarm = AdvantageAlarm()
    groups = [_group(7, [1.0, 0.0], [5, 3]), _group(9, [3e38, 3e38], [4, 6], "nvfp4"),
              _group(11, [INF, 0.0], [2, 2])]
    adv = np.asarray(compute_advantages(np.asarray([g_rewards(g) for g in groups], np.float32)))
    values, lines = alarm.check(groups, adv)
    assert values["dropped/non_finite_advantage"] == pytest.approx((4 + 6 + 2 + 2) / (5 + 3 + 4 + 6 + 2 + 2))
    assert values["dropped/non_finite_advantage_groups"] == 2
    (line,) = lines
    assert "task 9" in line and "nvfp4" in line and "10 tokens dropped" in line and "3e+38" in line
    # The next step: counted again, not alarmed again.
    values, lines = alarm.check(groups[1:2], adv[1:2])
    assert lines == [] and values["dropped/non_finite_advantage"] == 1.0 and alarm.groups_total == 3
    values, lines = alarm.check(groups[:1], adv[:1])
    assert lines == [] and values == {"dropped/non_finite_advantage": 0.0,
                                      "dropped/non_finite_advantage_groups": 0.0}


def g_rewards(g) -> list[float]:
    return [t.reward for t in g.trajectories]
