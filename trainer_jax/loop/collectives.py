"""The learn stage and every other collective of the loop, both halves of the lockstep protocol.

With several JAX processes each collective (a train step, the gathers of a weights publication,
the calibration and version-probe forwards, a checkpoint) must be entered by every process in the
same order on the same inputs (``trainer_jax.parallel.lockstep``). Process 0 owns the loop and
calls the methods here: each announces its order, then joins the collective, sharing its inputs.
The other processes run ``follow``: a table from order to the same collective's other half, run
on empty inputs of the shapes process 0 shares. They write no metrics and talk to no sampler.
On one process the announcements and shares are no-ops.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from trainer_jax.calibration import calibrate
from trainer_jax.checkpoint import Checkpointer
from trainer_jax.config import RunConfig
from trainer_jax.learner import Learner, StepResult
from trainer_jax.loop.batches import batch_template
from trainer_jax.parallel.lockstep import CALIBRATE, CHECKPOINT, PROBE, PUBLISH, STEP, STOP, Lockstep, Order
from trainer_jax.probe import inputs_template, run_shared
from trainer_jax.publisher import snapshot


class Collectives:
    """The loop's collectives over ``learner``'s model and optimizer.

    ``meta`` is the loop's checkpointed state (``step``, ``version``, ...), shared with the loop:
    each order carries its current step and version, and a follower takes them from each order.
    """

    def __init__(self, cfg: RunConfig, lockstep: Lockstep, learner: Learner, checkpointer: Checkpointer,
                 meta: dict):
        self.cfg, self.lockstep, self.learner = cfg, lockstep, learner
        self.model, self.checkpointer, self.meta = learner.model, checkpointer, meta
        self._calibration_cache: dict = {}  # a follower's calibration forward, compiled once
        self._probe_cache: dict = {}  # a follower's probe forwards
        self._empty_batch: tuple | None = None  # a follower's side of a step's broadcast

    def _announce(self, command: str, failed: bool = False) -> None:
        self.lockstep.announce(Order(command, int(self.meta["step"]), int(self.meta["version"]), failed))

    # ---------------------------------------------------------------- process 0: announce, then join

    def step(self, inputs, batch) -> StepResult:
        """One optimizer step on process 0's batch (the learn stage)."""
        self._announce(STEP)
        with self.lockstep.collective():
            return self.learner.step(*self.lockstep.share((inputs, batch)))

    def snapshot(self) -> dict[str, np.ndarray]:
        """The parameters as host arrays for a publish (a gather every process joins)."""
        self._announce(PUBLISH)
        with self.lockstep.collective():
            return snapshot(self.model)

    def calibration_ids(self, ids: np.ndarray, segment_ids: np.ndarray) -> tuple:
        """Announce a calibration forward; the ids every process runs it on."""
        self._announce(CALIBRATE)
        return self.lockstep.share((ids, segment_ids))

    def probe_inputs(self, inputs: tuple) -> tuple:
        """Announce the version probe's forwards; the inputs every process runs them on."""
        self._announce(PROBE)
        return self.lockstep.share(inputs)

    def checkpoint(self, **leader_meta) -> None:
        """Save a checkpoint of the step in ``meta``; ``leader_meta`` (process 0's task cursor,
        cost ledger) commits with it."""
        self.meta.update(leader_meta)
        self._announce(CHECKPOINT)
        self._save()

    def stop(self, failed: bool) -> None:
        """Tell the others the loop is over (``failed``: on an error), and stop watching them."""
        self._announce(STOP, failed)
        self.lockstep.finish()

    # ---------------------------------------------------------------- the others: answer orders

    def _save(self) -> None:
        with self.lockstep.collective():
            self.checkpointer.save(self.meta["step"], self.model, self.learner.optimizer, self.meta)

    def _follow_step(self, order: Order) -> None:
        with self.lockstep.collective():
            self.learner.step(*self.lockstep.share(self._empty_batch))

    def _follow_publish(self, order: Order) -> None:
        with self.lockstep.collective():
            snapshot(self.model)  # this process's part of the gathers; process 0 writes

    def _follow_calibrate(self, order: Order) -> None:  # process 0 keeps the maxima
        empty = np.zeros((1, self.cfg.train.weights.calibration_tokens), np.int32)
        with self.lockstep.collective():
            ids, segment_ids = self.lockstep.share((empty, empty))
            calibrate(self.model, ids, segment_ids, version=order.version, sequences=1,
                      cache=self._calibration_cache)

    def _follow_probe(self, order: Order) -> None:  # process 0 writes probe.json
        pcfg = self.cfg.service.probe
        with self.lockstep.collective():
            inputs = self.lockstep.share(inputs_template(pcfg.prompts, pcfg.tokens))
            run_shared(self.model, inputs, pcfg.tokens, pcfg.seed, self._probe_cache)

    def follow(self) -> int:
        """Answer process 0's orders until it says stop; return the step it stopped at."""
        self._empty_batch = batch_template(self.cfg)  # the batch shapes, for the broadcast
        table: dict[str, Callable[[Order], None]] = {
            STEP: self._follow_step, PUBLISH: self._follow_publish, CALIBRATE: self._follow_calibrate,
            PROBE: self._follow_probe, CHECKPOINT: lambda order: self._save()}
        try:
            while True:
                order = self.lockstep.next_order()
                self.meta.update(step=order.step, version=order.version)
                if order.command == STOP:
                    if order.failed:
                        raise RuntimeError("process 0 stopped on an error (its output says which)")
                    return order.step
                if order.command not in table:
                    raise RuntimeError(f"unknown order {order.command!r} from process 0")
                table[order.command](order)
        finally:
            self.checkpointer.close()
            self.lockstep.finish()


__all__ = ["Collectives"]
