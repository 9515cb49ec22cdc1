"""Kept sets and ``train.support_k``: a config whose top-p could record a kept set wider than the
learner's support columns is refused at load, and a submitted sample whose kept set is wider anyway
is refused over real gRPC with a counted reason (the learner's packer would otherwise raise)."""

import numpy as np
import pytest
from fakes import fake_records

from mixrl_wire.encoder import build_trajectory
from sampler_torch.client import Backoff, RolloutClient
from trainer_jax.config import ConfigError, load_config
from trainer_jax.service import RolloutService

TOKEN = "support-k-token"


@pytest.mark.parametrize(("overrides", "match"), [
    (["tasks.sampling.top_p=0.9"], r"tasks.sampling.top_p 0.9 < 1 with objective.top_p_replay needs "
                                   r"0 < tasks.sampling.top_k <= train.support_k \(64\), got top_k 0"),
    (["tasks.sampling.top_p=0.9", "tasks.sampling.top_k=8", "train.support_k=4"],
     r"tasks.sampling.top_k <= train.support_k \(4\), got top_k 8"),
    (["tasks.sampling.top_k=80"], r"tasks.sampling.top_k 80 > train.support_k 64"),
])
def test_config_refuses_kept_sets_wider_than_support_k(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def test_configs_whose_kept_sets_fit_load():
    load_config(None, ["tasks.sampling.top_p=0.9", "tasks.sampling.top_k=64"])
    load_config(None, ["tasks.sampling.top_p=0.9", "objective.top_p_replay=false"])  # counted later
    load_config(None, ["tasks.sampling.top_k=64"])


def test_a_submitted_kept_set_wider_than_support_k_is_refused_and_counted():
    cfg = load_config(None, ["service.listen=127.0.0.1:0", "tasks.group_size=2", "tasks.sampling.top_p=0.9",
                             "tasks.sampling.top_k=4", "train.support_k=4", "tasks.sampling.head_k=3",
                             "tasks.sampling.max_new_tokens=6"])
    svc = RolloutService.from_config(cfg, token=TOKEN).start()
    c = RolloutClient(svc.address, TOKEN, group="g", capacity=4, name="wide",
                      backoff=Backoff(initial_s=0.01, max_s=0.1), max_retry_s=3.0)
    try:
        c.register()
        task = c.lease(2).tasks[0]
        rng = np.random.default_rng(0)

        def submit(sample: int, top_k: int):
            rec = fake_records(5, svc.vocab_size, task.sampling.head_k, rng, top_k=top_k)
            tokens = rec.pop("token_ids")
            msg = build_trajectory(task, sample, token_ids=tokens, loss_mask=np.ones(5, np.uint8),
                                   finish_reason="length", generate_ms=1.0, **rec)
            return c.submit(msg)

        wide = submit(0, top_k=6)  # six ids kept at every position: more than support_k = 4
        assert not wide.accepted and wide.reason.startswith("support_indptr: the kept set at policy "
                                                            "position 0 has 6 ids, more than "
                                                            "train.support_k = 4"), wide
        st = svc.status()
        assert st["totals"]["rejected"] == 1 and st["samplers"][0]["rejections"] == {"support_indptr": 1}
        assert submit(0, top_k=4).accepted  # the same lease, a kept set that fits
        assert svc.status()["totals"]["accepted"] == 1
    finally:
        c.close()
        svc.stop(grace=0)
