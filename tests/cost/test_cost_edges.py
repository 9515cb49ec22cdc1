"""Edge cases of the useful share and of policy cost's staleness bound (trainer_jax.cost): a group
whose tokens were all dropped, and tokens masked out of the loss for ``train.max_staleness``."""

from __future__ import annotations

import numpy as np
import pytest

from trainer_jax.batching import Sample
from trainer_jax.config import load_config
from trainer_jax.cost import TrainerCost, useful_share


def test_a_group_whose_tokens_were_all_dropped_has_useful_share_zero():
    # The objective's out_of_range is a mean over the kept tokens: with none kept it is NaN, and
    # the share is 0 (every token dropped), not unknown.
    assert useful_share(1.0, float("nan")) == 0.0
    assert useful_share(1.0, None) == 0.0
    assert useful_share(0.5, float("nan")) is None  # some kept yet no out-of-range figure: unknown
    assert useful_share(float("nan"), float("nan")) is None  # no token of the group at all


def _sample(group: int, versions: list[int]) -> Sample:
    p = len(versions)
    return Sample(token_ids=np.arange(p + 1, dtype=np.int32),
                  loss_mask=np.array([0] + [1] * p, np.int32),
                  logprobs=np.zeros(p, np.float32), head_ids=np.zeros((p, 1), np.int32),
                  head_logprobs=np.zeros((p, 1), np.float32),
                  support_indptr=np.zeros(p + 1, np.int32), support_ids=np.zeros(0, np.int32),
                  support_logprobs=np.zeros(0, np.float32), versions=np.array(versions, np.int32),
                  group=group)


def test_stale_tokens_are_not_useful_and_trip_the_staleness_bound():
    """``train.max_staleness: 1`` at trainer version 5: ``fresh``'s tokens are 0-1 versions
    behind, ``old``'s 3 (all masked out of the loss by the packer, so the objective's own
    staleness and dropped metrics never see them). ``old`` is not useful and is over the bound;
    ``fresh`` keeps its share and stays within."""
    from trainer_jax.service import RolloutService

    cfg = load_config(None, ["service.listen=127.0.0.1:0", "train.max_staleness=1",
                             "service.router.policy=cost",
                             "groups=[{name: fresh, spawn: false, price_per_hour: 2.0},"
                             " {name: old, spawn: false, price_per_hour: 1.0}]"])
    svc = RolloutService.from_config(cfg, token="t0k")  # not started: status() and the router
    clock = [0.0]
    cost = TrainerCost(cfg.group_prices(), {}, clock=lambda: clock[0])
    samples = [_sample(0, [5, 4, 4, 5]), _sample(0, [4, 4, 4, 4]), _sample(1, [2, 2, 2, 2])]
    # What the objective reports over the tokens it saw: fresh's 8, 1/4 of the kept out of range;
    # old's none at all (NaN: no token of it reached the loss).
    nan = float("nan")
    values = {"version": 5, "group/fresh/dropped": 0.0, "group/fresh/out_of_range": 0.25,
              "group/fresh/staleness": 0.625, "group/old/dropped": nan, "group/old/out_of_range": nan,
              "group/old/staleness": nan}
    clock[0] = 10.0
    out = cost.step(svc, ["fresh", "old"], samples, [0, 1, 2], values)
    assert out["group/fresh/useful_share"] == pytest.approx(0.75)
    assert out["group/old/useful_share"] == 0.0
    assert out["group/old/stale_share"] == 1.0 and out["group/fresh/stale_share"] == 0.0
    g = cost.ledger.groups
    assert g["old"].useful_samples == 0.0 and g["fresh"].useful_samples == pytest.approx(1.5)
    router = svc.router.groups
    assert router["old"].useful_share == 0.0 and router["old"].stale
    assert not router["fresh"].stale


def test_policy_cost_refuses_a_free_group_at_load(tmp_path):
    """Policy cost weighs by useful samples per dollar: a group at 0 USD/h has no finite weight
    (the router would floor it as unpriced). One line at load, not a starved group in the run."""
    from trainer_jax.config import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text("service: {router: {policy: cost}}\nprices: {cpu: 0}\n"
                    "groups: [{name: a, price_per_hour: 2.0}, {name: own, accelerator: cpu}]\n")
    with pytest.raises(ConfigError, match=r"policy cost: group 'own' costs 0 USD/h") as e:
        load_config(path)
    assert "\n" not in str(e.value)
    load_config(path, ["service.router.policy=throughput"])  # the ledger takes a free group


def test_plan_survives_a_group_whose_trained_tokens_were_all_dropped(tmp_path, capsys):
    """A run without the cost ledger where group ``z`` trained samples but kept no token (its
    ``group/z/tokens`` 0, no out-of-range figure): the planner excludes it with a reason instead
    of dividing by its 0 tokens per sample."""
    import json

    import yaml

    from experiments.plan import plan_main

    run = tmp_path / "run"
    run.mkdir()
    rows = []
    for s in range(1, 5):
        rows.append({"step": s, "samples_trained": 20.0,
                     "group/a/sample_share": 0.5, "group/a/tokens": 100.0, "group/a/tokens_per_s": 50.0,
                     "group/a/k3": 0.01, "group/a/out_of_range": 0.0, "group/a/dropped": 0.0,
                     "group/z/sample_share": 0.5, "group/z/tokens": 0.0, "group/z/tokens_per_s": 50.0,
                     "group/z/dropped": 1.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    priced = {"a": {"accelerator": "H100", "price_per_hour": 2.0},
              "z": {"accelerator": "L4", "price_per_hour": 1.0}}
    (run / "summary.json").write_text(json.dumps({"cost": {"groups": priced}}))
    limits = tmp_path / "limits.yaml"
    limits.write_text("source: a test's own figures\n")
    out = tmp_path / "plan.yaml"
    assert plan_main([str(run), "--budget", "4", "--limits", str(limits), "--out", str(out)]) == 0
    plan = yaml.safe_load(out.read_text())
    assert {g["name"]: g["processes"] for g in plan["groups"]} == {"a": 2, "z": 0}
    assert "z" in plan["excluded"]
