"""Issue 48 item 3: an evaluation-only sampler group (``groups[].eval_only``).

The router part runs on a real ``Router``; the leasing part on a real rollout service over loopback
with real clients (trajectories synthetic but valid).
"""

from __future__ import annotations

import dataclasses

import pytest

from sampler_torch.client import Backoff, RolloutClient
from trainer_jax.config import RouterConfig, load_config
from trainer_jax.service import RolloutService
from trainer_jax.service.router import Router

TOKEN = "eval-only-token"
GROUPS = "groups=[{name: train, recipe: bf16}, {name: clean, recipe: bf16, eval_only: true}]"
BASE = ["service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.max_new_tokens=8",
        "tasks.sampling.head_k=4", "service.buffer.max_trajectories=8", GROUPS, "train.eval_group=clean"]


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("policy", ["throughput", "uniform", "capacity", "cost"])
def test_router_gives_an_eval_only_group_no_training_share(policy):
    clock = _Clock()
    router = Router(RouterConfig(policy=policy, min_share=0.1), clock=clock)
    router.configure({"a": 1.0, "b": 2.0, "clean": 1.0}, eval_only=["clean"])
    for name in ("a", "b", "clean"):
        g = router.group(name)
        g.samplers, g.capacity = 1, 4
    clock.t = 1.0
    router.record("clean", 1000, evaluation=True)  # the fastest group by far: still no share
    router.record("a", 10)
    router.record("b", 10)
    clock.t = 100.0
    shares = router.shares()
    assert shares["clean"] == 0.0
    assert sum(shares[g] for g in ("a", "b")) == pytest.approx(1.0)
    assert router.quota("clean", 64, unit=1) == 0 and router.quota("a", 64, unit=1) >= 1
    assert router.is_eval_only("clean") and not router.is_eval_only("a")
    assert router.snapshot()["clean"]["eval_only"] is True
    # Without the flag the same group takes the lion's share (the test above is not vacuous).
    plain = Router(RouterConfig(policy="throughput", min_share=0.1), clock=clock)
    for name in ("a", "clean"):
        g = plain.group(name)
        g.samplers, g.capacity = 1, 4
    plain.record("clean", 1000)
    plain.record("a", 10)
    clock.t = 200.0
    assert plain.shares()["clean"] > 0.5


def test_eval_only_config_loads_and_eval_group_must_name_a_group():
    cfg = load_config(None, BASE[5:])
    assert [g.eval_only for g in cfg.groups] == [False, True] and cfg.eval_group == "clean"
    with pytest.raises(Exception, match=r"train.eval_group 'nope' is not a group"):
        load_config(None, [GROUPS, "train.eval_group=nope"])
    assert load_config(None, [GROUPS]).eval_group == "clean"  # the eval-only group is the default
    with pytest.raises(Exception, match=r"'clean' is eval_only but train.eval_group is 'train'"):
        load_config(None, [GROUPS, "train.eval_group=train"])
    with pytest.raises(Exception, match=r"'clean' is eval_only but no evaluation is configured"):
        load_config(None, [GROUPS, "train.eval_tasks=0"])
    with pytest.raises(Exception, match=r"every group is eval_only"):
        load_config(None, ["groups=[{name: clean, recipe: bf16, eval_only: true}]"])


def test_the_default_evaluation_group_is_a_bf16_group_without_a_dial():
    dialed = ("groups=[{name: r2, recipe: bf16, round_weights: {bits: 2, block_size: 32}}, "
              "{name: noisy, recipe: bf16, logit_noise: 1.0}, {name: fp8, recipe: fp8}, "
              "{name: plain, recipe: bf16}]")
    assert load_config(None, [dialed]).eval_group == "plain"


@pytest.fixture
def svc():
    cfg = load_config(None, BASE)
    service = RolloutService.from_config(cfg, token=TOKEN).start()
    assert service.router.is_eval_only("clean")  # from_config tells the router
    yield service
    service.stop(grace=0)


def _client(svc, group) -> RolloutClient:
    return RolloutClient(svc.address, TOKEN, group=group, capacity=8, name=group,
                         backoff=Backoff(initial_s=0.01, max_s=0.1), max_retry_s=3.0)


def test_an_eval_only_group_leases_only_evaluation_tasks(svc):
    train, clean = _client(svc, "train"), _client(svc, "clean")
    clean.register()
    train.register()
    clean.heartbeat(weights_version=0)
    # Training tasks are pending, but the evaluation-only group gets none of them.
    assert not clean.lease(8).tasks
    source = svc.source
    specs = [dataclasses.replace(source.spec(1000 + i, group_size=2), evaluation=True, group="clean")
             for i in range(2)]
    ids = svc.scheduler.add_evaluation(specs)
    assert not train.lease(8).tasks or all(t.task_id not in ids for t in train.lease(8).tasks)
    tasks = clean.lease(8).tasks
    assert sorted(t.task_id for t in tasks) == ids
    assert not clean.lease(8).tasks  # nothing but evaluation, and that is all leased
