"""The build-the-batch stage: complete prompt groups -> advantages -> one fixed-shape packed batch.

Advantages are group-relative (``train.advantage``), computed per prompt group before packing.
Samples that do not fit the batch (its row or token budget) are carried into the next one, first
in line, with the advantages of their own prompt group; at most ``carry`` samples are carried
(the mode's limit: one step's worth asynchronously, none in synchronous mode, where a leftover
sample is of a version the next step must not train on), the rest counted as dropped. A sample
longer than a row is counted and skipped.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from trainer_jax.batching import PackedInputs, Sample, pack
from trainer_jax.config import RunConfig
from trainer_jax.diagnostics import AdvantageAlarm
from trainer_jax.objective import TokenBatch, compute_advantages

#: ``MIXRL_SAVE_TRAJECTORIES=N`` keeps up to N trained samples of the latest step (``save_trajectories``)
SAVE_ENV = "MIXRL_SAVE_TRAJECTORIES"


@dataclasses.dataclass
class Batch:
    """One step's batch: the learner's arrays and where they came from.

    ``samples``: every candidate sample (carried ones first); ``taken``: the indices packed;
    ``rewards`` [P, G]: the step's new groups' rewards; ``advantage_metrics`` / ``advantage_alarms``:
    non-finite advantages (``diagnostics.AdvantageAlarm``).
    """

    inputs: PackedInputs
    tokens: TokenBatch
    samples: list[Sample]
    taken: list[int]
    rewards: np.ndarray
    advantage_metrics: dict[str, float]
    advantage_alarms: list[str]

    def trained_sequences(self):
        """The token ids of the samples trained (what a calibration observes)."""
        return (self.samples[i].token_ids for i in self.taken)


def pack_batch(cfg: RunConfig, samples: list[Sample], advantages: np.ndarray, version: int
               ) -> tuple[PackedInputs, TokenBatch, list[int]]:
    """``batching.pack`` with the run's batch shape, at trainer version ``version``."""
    return pack(samples, advantages, rows=cfg.train.rows, row_len=cfg.train.row_len,
                max_tokens=cfg.train.max_tokens, head_k=cfg.tasks.sampling.head_k,
                support_k=cfg.train.support_k, temperature=cfg.tasks.sampling.temperature,
                trainer_version=version, max_staleness=cfg.train.max_staleness)


def batch_template(cfg: RunConfig) -> tuple[PackedInputs, TokenBatch]:
    """An empty batch of the run's shapes (what the other processes pass to a broadcast)."""
    return pack_batch(cfg, [], np.zeros(0, np.float32), 0)[:2]


class BatchBuilder:
    """``build(groups, version) -> Batch``; keeps the carried samples and the counts of dropped
    (``carry_dropped``) and too-long (``too_long``) samples, which the step metrics report."""

    def __init__(self, cfg: RunConfig, *, carry: int):
        self.cfg, self.carry_limit = cfg, carry
        self.index = {g.name: i for i, g in enumerate(cfg.groups)}
        self.carry: list[tuple[Sample, float]] = []
        self.carry_dropped = 0
        self.too_long = 0
        self.advantage_alarm = AdvantageAlarm()  # groups whose float32 advantages are not finite

    def build(self, groups: list, version: int) -> Batch:
        rewards = np.asarray([[t.reward or 0.0 for t in g.trajectories] for g in groups], np.float32)
        adv = np.asarray(compute_advantages(jnp.asarray(rewards), self.cfg.train.advantage))
        adv_metrics, adv_alarms = self.advantage_alarm.check(groups, adv)
        samples, sample_adv = [s for s, _ in self.carry], [a for _, a in self.carry]
        for g, a in zip(groups, adv, strict=True):
            for t, ai in zip(g.trajectories, a, strict=True):
                sample = Sample.from_record(t, g.task.prompt_ids, self.index.get(t.group, 0))
                if len(sample.token_ids) > self.cfg.train.row_len:  # cannot be packed: count, skip
                    self.too_long += 1
                    continue
                samples.append(sample)
                sample_adv.append(ai)
        inputs, tokens, taken = pack_batch(self.cfg, samples, np.asarray(sample_adv, np.float32), version)
        left = sorted(set(range(len(samples))) - set(taken))
        self.carry = [(samples[i], sample_adv[i]) for i in left][:self.carry_limit]
        self.carry_dropped += max(0, len(left) - self.carry_limit)
        return Batch(inputs, tokens, samples, taken, rewards, adv_metrics, adv_alarms)


def save_trajectories(run_dir: Path, batch: Batch, *, step: int, version: int,
                      group_names: list[str]) -> None:
    """Opt-in (``MIXRL_SAVE_TRAJECTORIES=N``): keep up to N trained samples of the latest step.

    Written as ``trajectories.pkl`` in the run dir (overwritten each step, so the file holds the
    last step's batch) for offline analysis (the drift report's gradients);
    off by default, so ordinary runs are unchanged.
    """
    n = int(os.environ.get(SAVE_ENV, "0") or 0)
    if n <= 0:
        return
    keep = [batch.samples[i] for i in list(batch.taken)[:n]]
    record = {"step": step, "trainer_version": int(version), "group_names": group_names, "samples": keep}
    tmp = run_dir / "trajectories.pkl.tmp"
    tmp.write_bytes(pickle.dumps(record))
    tmp.replace(run_dir / "trajectories.pkl")


__all__ = ["SAVE_ENV", "Batch", "BatchBuilder", "batch_template", "pack_batch", "save_trajectories"]
