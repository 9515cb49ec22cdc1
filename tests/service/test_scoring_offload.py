"""A slow reward function never holds the rollout service's RPC threads: a submission is acked once
validated and committed, its reward is computed on a scoring thread, and its group reaches the
training buffer (or the evaluation) only once scored. Real service on loopback, real reward
workers; the reward (``user_rewards:sleeps``) takes 1.5 s a call."""

import dataclasses
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fakes import fake_trajectory

from convert.tokenizer import char_tokenizer
from sampler_torch.client import Backoff, RolloutClient
from trainer_jax.config import MixEntry, load_config
from trainer_jax.service import RolloutService
from trainer_jax.service.tasks import EnvTaskSource

TOKEN = "scoring-token"
SLEEP_S = 1.5
USER_REWARDS = Path(__file__).parents[1] / "envs"


@pytest.fixture(params=[None])
def svc(request, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(USER_REWARDS))  # the reward workers inherit the import path
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"q": f"{i}?", "a": str(i), "sleep": SLEEP_S}) + "\n"
                            for i in range(8)))
    options = {"path": str(rows), "prompt_key": "q", "answer_key": "a", "reward": "user_rewards:sleeps",
               "reward_workers": 2, "reward_timeout_s": 20}
    source = EnvTaskSource([MixEntry(env="dataset", options=options)], group_size=2,
                           tokenizer=char_tokenizer(), count=request.param)
    cfg = load_config(None, ["service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.head_k=4",
                             "tasks.sampling.max_new_tokens=8"])
    service = RolloutService.from_config(cfg, token=TOKEN, source=source).start()
    yield service
    service.stop(grace=0)
    source.close()


def _client(svc) -> RolloutClient:
    c = RolloutClient(svc.address, TOKEN, group="g", capacity=8, name="offload",
                      backoff=Backoff(initial_s=0.05, max_s=0.2), max_retry_s=10.0)
    c.register()
    return c


def test_submit_is_acked_before_the_reward_and_the_group_waits_for_it(svc):
    c = _client(svc)
    rng = np.random.default_rng(0)
    task = c.lease(2).tasks[0]
    trajs = [fake_trajectory(task, i, svc.vocab_size, rng) for i in task.sample_indices]
    for t in trajs:
        t.reward = 0.25  # the sampler's claim: replaced by the trainer's score
    t0 = time.monotonic()
    acks = [c.submit(t) for t in trajs]
    took = time.monotonic() - t0
    assert all(a.accepted and not a.duplicate for a in acks)
    # Before: each submit waited for its 1.5 s reward call on the RPC thread.
    assert took < SLEEP_S, f"two submissions took {took:.2f} s"
    assert svc.buffer.ready_groups == 0 and svc.buffer.snapshot()["scoring_samples"] > 0
    assert c.submit(trajs[0]).duplicate  # a replay while it is scored is still a duplicate
    groups = svc.buffer.take_groups(1, timeout=30)
    assert len(groups) == 1 and groups[0].rewards == [1.0, 1.0]
    assert svc.status()["totals"]["accepted"] == 2


@pytest.mark.parametrize("svc", [0], indirect=True)  # no training tasks: the lease is the evaluation's
def test_evaluation_waits_for_its_scores_and_the_backlog_is_bounded(svc):
    c = _client(svc)
    c.heartbeat(weights_version=0)  # evaluation goes to samplers that report their weights
    rng = np.random.default_rng(1)
    spec = dataclasses.replace(svc.source.spec(100, group_size=2), evaluation=True)
    done = {}
    waiter = threading.Thread(target=lambda: done.update(groups=svc.evaluate([spec], timeout=30)))
    waiter.start()
    deadline = time.monotonic() + 10
    tasks = []
    while not tasks and time.monotonic() < deadline:
        tasks = [t for t in c.lease(2).tasks]
    assert tasks and tasks[0].group_size == 2
    svc.buffer.capacity = 1  # one sample in scoring at a time: the second submission must wait
    t0 = time.monotonic()
    acks = [c.submit(fake_trajectory(tasks[0], i, svc.vocab_size, rng)) for i in tasks[0].sample_indices]
    assert all(a.accepted for a in acks)
    assert time.monotonic() - t0 >= SLEEP_S * 0.8  # refused until the first was scored, then retried
    assert svc.status()["totals"]["backpressure"] >= 1
    waiter.join(30)
    assert [t.reward for t in done["groups"][0].trajectories] == [1.0, 1.0]
    assert svc.buffer.ready_groups == 0  # evaluation never reaches the training buffer
