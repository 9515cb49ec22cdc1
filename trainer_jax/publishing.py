"""What a run publishes with: the ``Publisher`` (``trainer_jax.publisher``) wired to the trainer's
calibration (``train.weights.calibrate``) and version probe (``service.probe``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer_jax.calibration import Calibrator, fp8_kv_formats, group_kv_pairs
from trainer_jax.probe import Prober
from trainer_jax.publisher import Publisher
from trainer_jax.service.probes import RECORD_DIR

if TYPE_CHECKING:
    from trainer_jax.train import Trainer


def start_publisher(trainer: Trainer) -> Publisher:
    """The publisher of ``trainer``'s run; sets ``trainer.calibrator`` and ``trainer.prober``.

    Calibrated scales come from recent trajectories (from upcoming task prompts before the first
    one); the probe's prompts are the run's first tasks, fixed for the whole run (a resumed run
    rebuilds the same ones). Over several processes both forwards are collectives.
    """
    cfg, source = trainer.cfg, trainer.source
    wcfg, pcfg = cfg.train.weights, cfg.service.probe
    multi = trainer.lockstep.multi
    trainer.calibrator = Calibrator(
        trainer.model, wcfg.calibration_tokens, kv_floor=wcfg.kv_scale_floor,
        prompts=lambda: [source.spec(source.cursor + i).prompt_ids for i in range(16)],
        collective=trainer._calibration_ids if multi else None) if wcfg.calibrate else None
    trainer.prober = Prober([source.spec(i).prompt_ids for i in range(pcfg.prompts)],
                            tokens=pcfg.tokens, seed=pcfg.seed,
                            collective=trainer._probe_inputs if multi else None) \
        if pcfg.enabled else None
    prober = trainer.prober
    return Publisher(
        wcfg.root or trainer.run_dir / "weights", trainer.qcfg.to_hf_dict(), trainer.weight_formats,
        trainer.tokenizer_dir, cfg.train.keep_versions, trainer._on_published, delta=wcfg.delta,
        full_every=wcfg.full_every, engines=trainer.export_engines, calibrator=trainer.calibrator,
        kv_cache_formats=lambda: fp8_kv_formats(group_kv_pairs(
            cfg.groups, trainer.service.status()["samplers"])),
        prober=(lambda v: prober(trainer.model, v)) if prober else None,
        probe_dir=trainer.run_dir / RECORD_DIR)  # the probes' log p: kept, never published


__all__ = ["start_publisher"]
