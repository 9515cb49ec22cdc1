"""The publish stage: weights versions in every format a sampler loads, calibrated and probed.

``Publishing`` wires the background ``Publisher`` (``trainer_jax.publisher``) to its two forwards
over the policy being published, which it owns: the calibration of activation and K/V maxima
(``train.weights.calibrate``; from the newest trained samples, from upcoming task prompts before
the first) and the version probe (``service.probe``; the run's first task prompts, fixed for the
whole run, so a resumed run rebuilds the same ones). It is given what it needs, not the trainer:
the model, the ``snapshot`` function (the parameters as host arrays; a gather over several
processes), the announcements of its forwards over several processes, the rollout service that
announces each version, and where to write.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from convert.qwen3_config import Qwen3Config
from mixrl_wire.recipes import BACKENDS
from trainer_jax.calibration import Calibrator, fp8_kv_formats, group_kv_pairs
from trainer_jax.config import RunConfig
from trainer_jax.faults import during
from trainer_jax.models import Qwen3
from trainer_jax.probe import Prober
from trainer_jax.publisher import Publisher
from trainer_jax.resume import StorageError, storage_failure
from trainer_jax.service.probes import RECORD_DIR
from trainer_jax.service.server import RolloutService
from trainer_jax.service.tasks import TaskSource


def weight_formats(cfg: RunConfig, service: RolloutService) -> list[str]:
    """The config's formats, plus the preferred one of each sampler that loads none of them."""
    formats = cfg.weight_formats()
    return formats + [f for f in service.scheduler.unserved_formats(formats) if f not in formats]


def export_engines(cfg: RunConfig, service: RolloutService) -> str:
    """``mixrl`` while every sampler is the mixrl engine (it loads any shape), else ``serving``:
    projections a serving engine's kernels cannot take stay bf16 (``convert.export``). Tiny local
    models then keep their fp8 groups in fp8; a SGLang/vLLM group that joins switches the next
    version to serving layouts."""
    if any(not g.spawn for g in cfg.groups):
        return "serving"
    backends = {s["recipe"].get("backend", "") for s in service.status()["samplers"]}
    return "mixrl" if backends <= {BACKENDS["engine"], ""} else "serving"


class Publishing:
    """``now(version)`` publishes in this thread, ``request(version)`` in the background (the
    newest request wins); ``observe(batch)`` feeds the calibration the step's trained samples.

    ``calibration_ids`` / ``probe_inputs``: over several processes, the collectives that announce
    the calibration and probe forwards (``loop.collectives.Collectives``); ``None`` on one.
    """

    def __init__(self, cfg: RunConfig, model: Qwen3, model_config: Qwen3Config, source: TaskSource,
                 service: RolloutService, *, snapshot: Callable[[], dict], run_dir: Path,
                 tokenizer_dir: Path, calibration_ids: Callable | None = None,
                 probe_inputs: Callable | None = None):
        wcfg, pcfg = cfg.train.weights, cfg.service.probe
        self.service, self.snapshot = service, snapshot
        self.calibrator = Calibrator(
            model, wcfg.calibration_tokens, kv_floor=wcfg.kv_scale_floor,
            prompts=lambda: [source.spec(source.cursor + i).prompt_ids for i in range(16)],
            collective=calibration_ids) if wcfg.calibrate else None
        prober = Prober([source.spec(i).prompt_ids for i in range(pcfg.prompts)], tokens=pcfg.tokens,
                        seed=pcfg.seed, collective=probe_inputs) if pcfg.enabled else None
        self.publisher = Publisher(
            wcfg.root or run_dir / "weights", model_config.to_hf_dict(),
            lambda: weight_formats(cfg, service), tokenizer_dir, cfg.train.keep_versions,
            self._announce, delta=wcfg.delta, full_every=wcfg.full_every,
            engines=lambda: export_engines(cfg, service), calibrator=self.calibrator,
            kv_cache_formats=lambda: fp8_kv_formats(group_kv_pairs(cfg.groups, service.status()["samplers"])),
            prober=(lambda v: prober(model, v)) if prober else None,
            probe_dir=run_dir / RECORD_DIR)  # the probes' log p: kept, never published

    def _announce(self, version: int, paths: dict[str, Path]) -> None:
        self.service.publish_version(version, {k: str(v) for k, v in paths.items()},
                                     probe=self.publisher.probes.get(version))

    def observe(self, sequences) -> None:
        """The next publish calibrates on the newest trained samples (token id sequences)."""
        if self.calibrator:
            self.calibrator.observe(sequences)

    def now(self, version: int) -> dict[str, Path]:
        """Publish ``version`` before returning; ``{format: local directory}``."""
        return self.publisher.publish_now(version, self.snapshot())

    def request(self, version: int) -> None:
        """Publish ``version`` in the background (its snapshot, calibration and probe taken now)."""
        self.publisher.request(version, during("publish", self.snapshot()))

    def check(self) -> None:
        """``StorageError`` once a publication failed for lack of storage (more would fail too)."""
        if failure := storage_failure(self.publisher.errors):
            raise StorageError(f"weights publication failed, stopping: {failure}")

    @property
    def latest(self) -> int:
        """The newest version on disk."""
        return self.publisher.published[-1]

    @property
    def errors(self) -> list[str]:
        return self.publisher.errors

    def bytes_summary(self) -> str:
        return self.publisher.bytes_summary()

    def close(self) -> None:
        """Finish the pending publish, if any (idempotent)."""
        self.publisher.close()


__all__ = ["Publishing", "export_engines", "weight_formats"]
