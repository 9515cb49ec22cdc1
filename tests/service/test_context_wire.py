"""Long rows on the wire (issue 33, item 3): config load checks ``train.row_len`` against the
service limits, and with them raised a 262,144-token trajectory (head_k 20, support_k 64:
~173 MiB) goes through a real service over loopback gRPC from the real client."""

from __future__ import annotations

import numpy as np
import pytest
from test_service import client, lease_all, make_service

from mixrl_wire.encoder import encode_trajectory
from trainer_jax.config import ConfigError, load_config
from trainer_jax.config.checks import trajectory_wire_bytes

LONG = 262_144
SAMPLING = ["tasks.sampling.head_k=20", "tasks.sampling.top_p=0.95", "tasks.sampling.top_k=64",
            "train.support_k=64", f"tasks.sampling.max_new_tokens={LONG}"]


def test_row_len_checked_against_the_wire_limits():
    with pytest.raises(ConfigError, match=r"train.row_len 262144 > service.limits.max_trajectory_tokens "
                                          r"65536.*max_message_bytes >= 181666816 \(173 MiB"):
        load_config(None, [f"train.row_len={LONG}", *SAMPLING])
    with pytest.raises(ConfigError, match=r"max_message_bytes 67108864 < 181666816.*693 bytes per token"):
        load_config(None, [f"train.row_len={LONG}", f"service.limits.max_trajectory_tokens={LONG}",
                           *SAMPLING])
    need = trajectory_wire_bytes(LONG, 20, 64)
    assert need == 1024 + LONG * 693
    load_config(None, [f"train.row_len={LONG}", f"service.limits.max_trajectory_tokens={LONG}",
                       f"service.limits.max_message_bytes={need}", *SAMPLING])
    load_config(None, [])  # the defaults pass


def _long_trajectory(task, n: int, vocab: int):
    """A valid ``n``-token trajectory with a full head and a 64-id support set per token, built
    vectorised (every token the same distribution: uniform over ids 0..63)."""
    k = task.sampling.head_k
    support = np.tile(np.arange(64, dtype=np.int32), (n, 1))
    lp = np.full(n, np.log(1 / 64), np.float32)
    return encode_trajectory(
        task, 0, token_ids=np.zeros(n, np.int32), logprobs=lp, logprobs_full=lp,
        versions=np.zeros(n, np.int32), head_ids=np.tile(np.arange(k, dtype=np.int32), (n, 1)),
        head_logprobs=np.tile(-1.0 - 0.01 * np.arange(k, dtype=np.float32), (n, 1)),
        support_ids=support, support_logprobs=np.full((n, 64), np.log(1 / 64), np.float32),
        finish_reason="length")


@pytest.mark.timeout(300)
def test_a_262144_token_trajectory_passes_the_wire():
    need = trajectory_wire_bytes(LONG, 20, 64)
    svc = make_service(f"train.row_len={LONG}", f"service.limits.max_trajectory_tokens={LONG}",
                       f"service.limits.max_message_bytes={need}", *SAMPLING)
    try:
        assert svc.vocab_size >= 64
        c = client(svc)  # no max_message_bytes: the client takes the service's at registration
        task = lease_all(c, 2)[0]
        assert c.max_message_bytes == need
        traj = _long_trajectory(task, LONG, svc.vocab_size)
        assert 64 * 2**20 < len(traj) <= need  # over the old 64 MiB limit, within the bound
        result = c.submit(traj)
        assert result.accepted, result
        assert svc.status()["totals"]["accepted"] == 1
    finally:
        svc.stop(grace=0)


def test_context_rows_must_split_into_zigzag_chunks():
    with pytest.raises(ConfigError, match=r"train.row_len 100 is not a multiple of 2 x mesh.context = 8"):
        load_config(None, ["mesh.context=4", "train.row_len=100"])
    with pytest.raises(ConfigError, match=r"sft.row_len 100 .* 2 x mesh.context = 8"):
        load_config(None, ["mesh.context=4", "train.row_len=128", "sft.steps=1", "sft.row_len=100"])
    with pytest.raises(ConfigError, match="mesh.context"):
        load_config(None, ["mesh.context=-1"])
    assert load_config(None, ["mesh.context=4", "train.row_len=128"]).mesh.context == 4
