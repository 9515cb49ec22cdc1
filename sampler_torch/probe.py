"""The sampler's half of the version probe (``mixrl_wire.probe``, docs/wire.md): after each load,
score the version's ``probe.json`` with the backend and report to the trainer.

Every backend offers ``score(prompts, continuations)`` (raw log q of each continuation token) and
``weights_digest()`` (a fingerprint of what it serves; ``None`` where the server has none). A load
whose export files changed while the fingerprint did not is reported as ``weights_unchanged``:
the trainer then asks for a reload, and revokes the session if that does nothing either.

Torch-free: a third-party sampler can reuse it with any backend of that shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from convert.manifest import MANIFEST_NAME, ManifestError, read_manifest
from mixrl_wire import pb
from mixrl_wire.probe import PROBE_FILE, flatten, read_probe

log = logging.getLogger("mixrl.sampler")

#: files whose change does not change the weights (the manifest itself, the probe, metadata)
_NOT_WEIGHTS = {MANIFEST_NAME, PROBE_FILE}


def weight_files(directory: str | Path) -> dict[str, str] | None:
    """``{relative path: sha256}`` of the weight files of an export (from its manifest; ``None``
    without one)."""
    try:
        files = read_manifest(directory)["files"]
    except (OSError, ManifestError):
        return None
    return {rel: str(f["sha256"]) for rel, f in files.items() if rel not in _NOT_WEIGHTS}


def digest(backend: Any) -> str | None:
    """The backend's weight fingerprint, ``None`` if it offers none or cannot answer."""
    fn = getattr(backend, "weights_digest", None)
    if fn is None:
        return None
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - no fingerprint means no no-op check, not a failure
        log.warning("weights fingerprint unavailable: %s", e)
        return None


def build_report(backend: Any, version: int, directory: str | Path, *, before: str | None,
                 files_changed: bool) -> pb.ProbeReport:
    """Score ``directory``'s probe with ``backend`` (loaded as ``version``) into a report."""
    after = digest(backend)
    report = pb.ProbeReport(version=int(version), weights_digest=after or "")
    if files_changed and before is not None and after is not None and after == before:
        report.weights_unchanged = True
        return report
    try:
        probe = read_probe(directory)
        if probe is None:
            report.error = f"{PROBE_FILE} missing from version {version}"
            return report
        if probe.version != int(version):
            report.error = f"{PROBE_FILE} is of version {probe.version}, loaded as {version}"
            return report
        score = getattr(backend, "score", None)
        if score is None:
            report.error = f"backend {type(backend).__name__} cannot score tokens"
            return report
        report.logprobs.extend(flatten(score(probe.prompts, probe.continuations)))
        if probe.previous is not None:
            report.previous_logprobs.extend(
                flatten(score(probe.prompts, probe.previous.continuations)))
    except Exception as e:  # noqa: BLE001 - a probe that cannot run is reported, never fatal
        report.error = f"{type(e).__name__}: {e}"[:500]
        del report.logprobs[:]
        del report.previous_logprobs[:]
    return report


def verify_load(client: Any, backend: Any, version: int, directory: str | Path, *,
                before: str | None, files_changed: bool,
                reload: Callable[[], None]) -> pb.ProbeAck | None:
    """Report the probe of a load and follow the answer: ``RELOAD`` reloads (``reload()``) and
    reports again; the last answer is returned (``None`` if the trainer could not be told)."""
    while True:
        report = build_report(backend, version, directory, before=before,
                              files_changed=files_changed)
        try:
            ack = client.report_probe(report)
        except Exception as e:  # noqa: BLE001 - an old trainer without the call: unverified
            log.warning("probe report for version %d not delivered: %s", version, e)
            return None
        if report.error:
            log.warning("version %d probe not scored: %s", version, report.error)
        if ack.action != pb.ProbeAck.RELOAD:
            if ack.action == pb.ProbeAck.OK and not report.error:
                log.info("version %d probe: %s (KL %.2e, max |d log p| %.3f)", version,
                         ack.verdict, ack.kl, ack.max_abs)
            return ack
        log.warning("trainer asks to reload version %d: %s", version, ack.reason)
        reload()


__all__ = ["build_report", "digest", "verify_load", "weight_files"]
