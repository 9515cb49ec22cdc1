"""The loop's stages on their own (``trainer_jax.loop``, issue 47 item 1): the batch builder's
carry, and the two take/publish modes, whose differences used to be branches through the loop.

Records are wire-shaped stand-ins (what ``Sample.from_record`` reads); the packer, the advantages,
the task source and the version gate are the real ones."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from convert.tokenizer import char_tokenizer
from trainer_jax.config import load_config
from trainer_jax.loop.batches import BatchBuilder
from trainer_jax.loop.modes import Asynchronous, Synchronous, loop_mode
from trainer_jax.service.tasks import build_task_source

PROMPT = [5, 6]


def _cfg(*extra: str):
    # One row of 16 tokens: two samples of 2 + 5 tokens fill it, a third is left over.
    return load_config(None, ["train.rows=1", "train.row_len=16", "train.max_tokens=16",
                              "train.prompts_per_step=2", "tasks.group_size=2", *extra])


def _record(n: int, reward: float, version: int = 0, task: int = 0, index: int = 0):
    return SimpleNamespace(
        token_ids=np.arange(10, 10 + n, dtype=np.int32), loss_mask=np.ones(n, np.uint8),
        logprobs=np.full(n, -1.0, np.float32), head_ids=np.zeros((n, 1), np.int32),
        head_logprobs=np.full((n, 1), -1.0, np.float32), support_indptr=None,
        versions=np.full(n, version, np.int32), reward=reward, task_id=task, sample_index=index,
        group="bf16", finish_reason="stop")


def _group(task: int, rewards=(1.0, 0.0), n: int = 5, version: int = 0):
    return SimpleNamespace(task=SimpleNamespace(prompt_ids=PROMPT), trajectories=[
        _record(n, r, version, task, i) for i, r in enumerate(rewards)])


def test_samples_that_do_not_fit_go_first_next_step_with_their_own_advantages():
    builder = BatchBuilder(_cfg(), carry=4)
    first = builder.build([_group(0), _group(1, rewards=(0.0, 1.0))], version=0)
    assert first.taken == [0, 1] and len(builder.carry) == 2 and builder.carry_dropped == 0
    # GRPO within each prompt group: task 1's samples carry (-1, +1), not the next group's values.
    assert [round(float(a)) for _, a in builder.carry] == [-1, 1]
    assert [s.task_id for s, _ in builder.carry] == [1, 1]
    second = builder.build([_group(2, rewards=(1.0, 1.0))], version=0)
    assert [second.samples[i].task_id for i in second.taken] == [1, 1]  # the carried ones first
    adv = np.asarray(second.tokens.advantages)[:10]
    np.testing.assert_allclose(adv[:5], -1.0, atol=1e-4)
    np.testing.assert_allclose(adv[5:], 1.0, atol=1e-4)


def test_the_carry_is_capped_and_the_rest_counted_dropped():
    builder = BatchBuilder(_cfg(), carry=4)
    builder.build([_group(t) for t in range(4)], version=0)  # 8 samples, 2 fit, 6 left
    assert (len(builder.carry), builder.carry_dropped) == (4, 2)
    builder.build([_group(9, n=15)], version=0)  # 2 + 15 tokens > row_len: can never be packed
    assert builder.too_long == 2


def test_synchronous_mode_carries_nothing():
    cfg = _cfg("train.sync=true")
    mode = loop_mode(cfg, build_task_source(cfg.tasks, tokenizer=char_tokenizer()))
    assert isinstance(mode, Synchronous) and mode.carry == 0
    builder = BatchBuilder(cfg, carry=mode.carry)
    batch = builder.build([_group(0), _group(1)], version=0)
    assert len(batch.taken) == 2 and builder.carry == [] and builder.carry_dropped == 2
    assert isinstance(loop_mode(_cfg(), mode.gate.source), Asynchronous)


class _Publishing:
    """The publish stage's two calls, recorded."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def now(self, version: int) -> dict:
        self.calls.append(("now", version))
        return {"bf16": f"v{version}"}

    def request(self, version: int) -> None:
        self.calls.append(("request", version))


def test_asynchronous_mode_takes_what_is_there_and_publishes_in_the_background():
    cfg = _cfg()
    source = build_task_source(cfg.tasks, tokenizer=char_tokenizer())
    mode, publishing = Asynchronous(cfg, source), _Publishing()
    assert mode.source is source and mode.carry == 4
    asked: list[int] = []
    stale = _group(0, version=3)
    assert mode.take(lambda n: asked.append(n) or [stale, stale], version=7) == [stale, stale]
    assert asked == [2]  # no version check: whatever version made them
    assert mode.first(0, publishing) == {"bf16": "v0"}
    mode.publish(1, publishing)
    assert publishing.calls == [("now", 0), ("request", 1)] and mode.metrics() == {}


def test_synchronous_mode_replaces_stale_groups_and_releases_each_version_once_published():
    cfg = _cfg("train.sync=true")
    source = build_task_source(cfg.tasks, tokenizer=char_tokenizer())
    mode, publishing = Synchronous(cfg, source), _Publishing()
    assert mode.source is mode.gate and mode.source.next_task() is None  # nothing before a release
    mode.first(0, publishing)
    assert publishing.calls == [("now", 0)] and (mode.gate.version, mode.gate.left) == (0, 2)
    handed = [mode.source.next_task() for _ in range(3)]
    assert [t.min_version for t in handed[:2]] == [0, 0] and handed[2] is None
    batches = iter([[_group(0, version=0), _group(1, version=1)], [_group(2, version=0)]])
    groups = mode.take(lambda n: next(batches), version=0)
    assert [g.task.prompt_ids for g in groups] == [PROMPT, PROMPT] and len(groups) == 2
    assert mode.metrics() == {"sync/dropped_groups_total": 1}
    assert mode.gate.left == 1  # the dropped group's replacement task of version 0
    mode.publish(1, publishing)
    assert publishing.calls[-1] == ("now", 1) and (mode.gate.version, mode.gate.left) == (1, 2)


@pytest.mark.parametrize("sync", [False, True])
def test_the_mode_is_what_train_sync_names(sync):
    cfg = _cfg(f"train.sync={str(sync).lower()}")
    mode = loop_mode(cfg, build_task_source(cfg.tasks, tokenizer=char_tokenizer()))
    assert type(mode) is (Synchronous if sync else Asynchronous)
