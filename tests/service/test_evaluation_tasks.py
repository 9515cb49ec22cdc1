"""Evaluation rides the fleet: eval tasks go to one group at a version, are scored, never trained on.

Real service on loopback, real client; trajectories are synthetic but valid.
"""

import dataclasses
import threading

import numpy as np
import pytest
from fakes import fake_trajectory

from sampler_torch.client import Backoff, RolloutClient, RolloutError
from trainer_jax.config import load_config
from trainer_jax.service import RolloutService

TOKEN = "eval-token"
BASE = ["service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.max_new_tokens=8",
        "tasks.sampling.head_k=4", "service.buffer.max_trajectories=2"]


@pytest.fixture
def svc():
    cfg = load_config(None, BASE)
    service = RolloutService.from_config(cfg, token=TOKEN).start()
    yield service
    service.stop(grace=0)


def _client(svc, group, **kw) -> RolloutClient:
    return RolloutClient(svc.address, TOKEN, group=group, capacity=8, name=f"{group}-{len(kw)}",
                         backoff=Backoff(initial_s=0.01, max_s=0.1), max_retry_s=3.0, **kw)


def _eval_specs(svc, n, group, min_version=0):
    source = svc.source
    return [dataclasses.replace(source.spec(1000 + i, group_size=3), evaluation=True, group=group,
                                min_version=min_version) for i in range(n)]


def test_eval_tasks_go_to_their_group_at_their_version_and_skip_the_training_buffer(svc):
    rng = np.random.default_rng(0)
    other, evaluator = _client(svc, "fp8"), _client(svc, "bf16")
    other.register()
    evaluator.register()
    ids = svc.scheduler.add_evaluation(_eval_specs(svc, 2, "bf16", min_version=1))
    # The training buffer holds 2 samples: fill it, so only evaluation can still be leased.
    held = [t for t in other.lease(2).tasks]
    assert sum(len(t.sample_indices) for t in held) == 2
    assert all(t.task_id not in ids for t in held)
    # The eval group's sampler still holds version 0 (< min_version): nothing for it yet.
    evaluator.heartbeat(weights_version=0)
    assert not evaluator.lease(8).tasks
    evaluator.heartbeat(weights_version=1)
    assert not other.lease(8).tasks  # another group never gets eval tasks
    tasks = evaluator.lease(8).tasks
    assert sorted(t.task_id for t in tasks) == ids and all(t.group_size == 3 for t in tasks)

    done = {}
    waiter = threading.Thread(target=lambda: done.update(groups=svc.scheduler.wait_evaluation(ids, 30)))
    waiter.start()
    acks = evaluator.submit_many([fake_trajectory(t, i, svc.vocab_size, rng) for t in tasks
                                  for i in t.sample_indices])
    assert all(a.accepted for a in acks)
    waiter.join(30)
    groups = done["groups"]
    assert [g.task_id for g in groups] == ids and all(len(g.trajectories) == 3 for g in groups)
    # Scored by the trainer's path (the fake replies are wrong answers) and never buffered.
    assert all(t.reward == 0.0 for g in groups for t in g.trajectories)
    assert svc.buffer.ready_groups == 0 and svc.buffer.held_trajectories == 0
    status = svc.status()
    assert status["totals"]["accepted_eval"] == 6 and "accepted" not in status["totals"]


def test_unfinished_evaluation_times_out_and_is_withdrawn(svc):
    evaluator = _client(svc, "bf16")
    evaluator.register()
    ids = svc.scheduler.add_evaluation(_eval_specs(svc, 1, "bf16"))
    evaluator.heartbeat(weights_version=0)
    task = evaluator.lease(8).tasks[0]
    with pytest.raises(TimeoutError, match="1 of 1 evaluation tasks unfinished"):
        svc.scheduler.wait_evaluation(ids, timeout=0.2)
    rng = np.random.default_rng(1)
    acks = evaluator.submit_many([fake_trajectory(task, 0, svc.vocab_size, rng)])
    assert not acks[0].accepted and "withdrawn" in acks[0].reason
    assert svc.status()["pending_eval_items"] == 0
    assert svc.scheduler.sessions[evaluator.session_id].outstanding == 0


def test_a_sampler_asking_for_an_unpublished_format_gets_it_and_unknown_formats_are_refused(svc):
    _client(svc, "a", weight_formats=("bf16",)).register()
    _client(svc, "b", weight_formats=("nvfp4", "bf16")).register()  # bf16 serves it already
    assert svc.scheduler.unserved_formats(["bf16"]) == []
    _client(svc, "c", weight_formats=("nvfp4",)).register()
    assert svc.scheduler.unserved_formats(["bf16"]) == ["nvfp4"]
    assert svc.scheduler.unserved_formats(["bf16", "nvfp4"]) == []
    with pytest.raises(RolloutError, match="weight_formats.*int4"):
        _client(svc, "d", weight_formats=("int4",)).register()
