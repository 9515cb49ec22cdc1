"""The trainer on processes other than 0 of a multi-process run: run process 0's collectives.

Process 0 (``trainer_jax.train.Trainer``) owns the loop; it announces each collective as an
order (``trainer_jax.parallel.lockstep``). A follower has set up the same learner and warm
start, then only answers orders: a train step on the batch process 0 broadcasts, its part of the
gathers of a publication, of a calibration forward and of the version probe's forwards, its shards
of a checkpoint. It writes no metrics and talks to no sampler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from trainer_jax.calibration import calibrate
from trainer_jax.parallel.lockstep import CALIBRATE, CHECKPOINT, PROBE, PUBLISH, STEP, STOP
from trainer_jax.probe import inputs_template, run_shared
from trainer_jax.publisher import snapshot

if TYPE_CHECKING:
    from trainer_jax.train import Trainer


def follow(trainer: Trainer) -> dict:
    """Answer process 0's orders until it says stop; return this process's summary."""
    lockstep = trainer.lockstep
    trainer.console.print(f"process {lockstep.index}: following process 0's orders")
    empty = trainer._pack([], np.zeros(0, np.float32))[:2]  # the batch shapes, for the broadcast
    empty_ids = np.zeros((1, trainer.cfg.train.weights.calibration_tokens), np.int32)
    compiled: dict = {}  # the calibration forward, compiled once
    probe_compiled: dict = {}  # the probe's forwards
    pcfg = trainer.cfg.service.probe
    try:
        while True:
            order = lockstep.next_order()
            trainer.meta.update(step=order.step, version=order.version)
            if order.command == STEP:
                with lockstep.collective():
                    trainer.learner.step(*lockstep.share(empty))
            elif order.command == PUBLISH:
                with lockstep.collective():
                    snapshot(trainer.model)  # this process's part of the gathers; process 0 writes
            elif order.command == CALIBRATE:  # process 0 keeps the maxima
                with lockstep.collective():
                    ids, segment_ids = lockstep.share((empty_ids, empty_ids))
                    calibrate(trainer.model, ids, segment_ids, version=order.version, sequences=1,
                              cache=compiled)
            elif order.command == PROBE:  # process 0 writes probe.json
                with lockstep.collective():
                    inputs = lockstep.share(inputs_template(pcfg.prompts, pcfg.tokens))
                    run_shared(trainer.model, inputs, pcfg.tokens, pcfg.seed, probe_compiled)
            elif order.command == CHECKPOINT:
                trainer._save_checkpoint()
            elif order.command == STOP:
                if order.failed:
                    raise RuntimeError("process 0 stopped on an error (its output says which)")
                return {"run_dir": str(trainer.run_dir), "process": lockstep.index, "steps": order.step}
            else:
                raise RuntimeError(f"unknown order {order.command!r} from process 0")
    finally:
        trainer.checkpointer.close()
        lockstep.finish()
