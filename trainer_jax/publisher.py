"""Weight publication off the training thread: the newest request wins.

The training thread hands over a host snapshot of the parameters (the only work it does); if a
publish is still running when the next one is requested, the older pending request is dropped, so
a slow disk delays samplers' weights, never the learner. The formats are asked for at every
publish, so a group that joins asking for a new format gets it from the next version on.

With a ``calibrator`` (``trainer_jax.calibration``; ``train.weights.calibrate``) each request
first calibrates activation and K/V maxima on recent trajectories, in the caller's thread (the
weights the forward sees are the snapshot's), when a format needs them: nvfp4 (``input_scale``)
or one that a group loads with an FP8 e4m3 KV cache (``kv_cache_formats``, ``k_scale`` /
``v_scale``). A calibration that fails is reported in ``errors`` and that version is published
without it.

With a ``prober`` (``trainer_jax.probe``; ``service.probe``) each request also samples and scores
the version probe in the caller's thread and writes its tokens as ``probe.json`` into every
format (``mixrl_wire.probe``; not the trainer's log p, which a sampler could send back unscored);
``probes`` keeps the recent ones with their log p for the rollout service to judge reports
against, and ``probe_dir`` (``<run>/probes``, never published) keeps them on disk for
``mixrl-train serve``. A probe that fails is reported in ``errors`` and that version is published
without one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from convert.calibration import Calibration
from convert.formats import get_codec
from convert.publish import default_cache_dir, publish
from convert.store import open_store
from mixrl_wire.probe import PROBE_FILE, Probe
from trainer_jax.models import Qwen3
from trainer_jax.parallel.publish import iter_gathered_hf_tensors
from trainer_jax.service.probes import prune_records, write_record

#: probes kept in memory (reports come for recent versions only), and at least as many records
KEEP_PROBES = 8


def snapshot(model: Qwen3) -> dict[str, np.ndarray]:
    """The model's parameters as HF-named host arrays (what a publish writes).

    With several processes each parameter is gathered (a collective every process must join,
    in the same order); process 0 keeps the arrays, the others may drop them.
    """
    return dict(sorted(iter_gathered_hf_tensors(model)))


class Publisher:
    """Writes versions with ``convert.publish`` in a background thread.

    ``formats()`` names the formats of the next version; ``on_published(version, {format: dir})``
    runs after each one is on disk (the rollout service announces it to the samplers).
    ``out_root`` is a directory or an fsspec URL, checked here (a bad URL or missing credentials
    fail at start-up). With ``delta`` each format is written as a delta against its previous
    version, a full snapshot every ``full_every``; this process's first version is always a full
    snapshot (samplers start from its directories, and a restarted trainer has no base cached).
    """

    def __init__(self, out_root: Path | str, config: dict, formats: Callable[[], list[str]],
                 tokenizer_dir: Path, keep_last: int, on_published: Callable[[int, dict[str, Path]], None], *,
                 delta: bool = False, full_every: int = 10, engines: Callable[[], str] = lambda: "serving",
                 calibrator: Callable[[int], Calibration | None] | None = None,
                 kv_cache_formats: Callable[[], list[str]] = list,
                 prober: Callable[[int], Probe] | None = None, probe_dir: Path | None = None):
        self.store = open_store(out_root)
        self.out_root, self.config, self.formats = out_root, config, formats
        self.tokenizer_dir, self.keep_last, self.on_published = tokenizer_dir, keep_last, on_published
        self.delta, self.full_every = delta, full_every
        self.engines = engines  # which loaders the exports must suit (convert.export_hf ``engines``)
        self.calibrator, self.kv_cache_formats = calibrator, kv_cache_formats
        self.prober, self.probe_dir = prober, probe_dir
        # An object store's versions are staged locally; the full exports kept there are the
        # next deltas' bases and the directories samplers start from.
        self.cache_dir = None if self.store.local is not None else default_cache_dir(self.store)
        self._pending: tuple[int, dict] | None = None
        self._cond = threading.Condition()
        self._stop = False
        self.errors: list[str] = []
        self.published: list[int] = []
        self.reports: list[tuple[int, dict]] = []  # (version, {format: {bytes, full_bytes, delta_base}})
        self.probes: dict[int, Probe] = {}  # the newest versions' probes, by version
        self._thread = threading.Thread(target=self._run, name="mixrl-publisher", daemon=True)
        self._thread.start()

    def calibrate(self, version: int) -> tuple[Calibration | None, list[str]]:
        """The calibration of ``version`` and the formats that take its K/V scales; ``None``
        without a calibrator, when no format needs one, or when it failed (in ``errors``)."""
        kv = self.kv_cache_formats()
        if self.calibrator is None or not (kv or any(get_codec(f).calibrated_inputs
                                                     for f in self.formats())):
            return None, kv
        try:
            return self.calibrator(version), kv
        except (ValueError, FloatingPointError) as e:  # e.g. NaN activations: publish without
            self.errors.append(f"v{version}: calibration: {type(e).__name__}: {e}")
            return None, kv

    def probe(self, version: int) -> Probe | None:
        """The version probe of ``version`` (``None`` without a prober, or when it failed: in
        ``errors``)."""
        if self.prober is None:
            return None
        try:
            return self.prober(version)
        except (ValueError, FloatingPointError) as e:
            self.errors.append(f"v{version}: probe: {type(e).__name__}: {e}")
            return None

    def publish_now(self, version: int, tensors: dict) -> dict[str, Path]:
        """Calibrate and probe (in this thread) and publish ``version``; return ``{format:
        local directory}`` (a full one for the first)."""
        return self._publish(version, tensors, *self.calibrate(version), self.probe(version))

    def _publish(self, version: int, tensors: dict, calibration: Calibration | None,
                 kv_formats: list[str], probe: Probe | None = None) -> dict[str, Path]:
        first = not self.published
        remote = self.cache_dir is not None
        report: dict = {}
        full_every = 1 if first or not self.delta else self.full_every
        if probe is not None and self.probe_dir is not None:  # the record before any sampler loads
            write_record(self.probe_dir, probe)
        paths = publish(tensors, self.config, self.out_root, version, self.formats(),
                        keep_last=self.keep_last, tokenizer_dir=self.tokenizer_dir,
                        delta=self.delta or remote, full_every=full_every, cache_dir=self.cache_dir,
                        report=report, engines=self.engines(), calibration=calibration,
                        kv_cache_formats=kv_formats,
                        extra_json={PROBE_FILE: probe.public().to_json()} if probe is not None else None)
        self.published.append(version)
        self.reports.append((version, report))
        if probe is not None:
            self.probes[version] = probe
            for old in sorted(self.probes)[:-KEEP_PROBES]:
                del self.probes[old]
            if self.probe_dir is not None and self.keep_last is not None:  # as versions are kept
                prune_records(self.probe_dir, max(self.keep_last, KEEP_PROBES))
        self.on_published(version, paths)
        return {f: self.cache_dir / f for f in paths} if remote else paths

    def bytes_summary(self) -> str:
        """One line: bytes written per version, by format, against full exports."""
        if not self.reports:
            return "weights: nothing published"
        written = sum(r["bytes"] for _, rep in self.reports for r in rep.values())
        full = sum(r["full_bytes"] for _, rep in self.reports for r in rep.values())
        n = len(self.reports)
        per_fmt = {}
        for _, rep in self.reports:
            for fmt, r in rep.items():
                per_fmt.setdefault(fmt, []).append(r["bytes"])
        parts = ", ".join(f"{fmt} {np.mean(b) / 1e6:.2f} MB" for fmt, b in per_fmt.items())
        deltas = sum(r["delta_base"] is not None for _, rep in self.reports for r in rep.values())
        return (f"weights: {n} versions to {self.store.root}, {written / 1e6:.1f} MB written "
                f"({100 * written / max(full, 1):.1f} % of {full / 1e6:.1f} MB in full exports; "
                f"{deltas} format-versions as deltas); per version: {parts}")
    def request(self, version: int, tensors: dict) -> None:
        """Publish ``version`` in the background (calibrated here, in the caller's thread)."""
        calibration = self.calibrate(version)
        probe = self.probe(version)
        with self._cond:
            self._pending = (version, tensors, *calibration, probe)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stop:
                    self._cond.wait()
                if self._pending is None:  # stopping, nothing left to publish
                    return
                version, tensors, calibration, kv_formats, probe = self._pending
                self._pending = None
            try:
                self._publish(version, tensors, calibration, kv_formats, probe)
            except Exception as e:  # keep training; samplers keep the previous version
                self.errors.append(f"v{version}: {type(e).__name__}: {e}")

    def close(self) -> None:
        """Finish the pending publish, if any, and stop (idempotent)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()
