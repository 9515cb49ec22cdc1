"""What ``--resume`` does to a run directory, file by file, and how a failed checkpoint save is
reported (issue 37; docs/testing.md).

``trainer_jax/resume.py``'s version and metric bookkeeping was only reached by the crash tests
(real killed trainers, minutes): its mutants survived the checkpoint tests. These call it on real
directories; each takes milliseconds."""

from __future__ import annotations

import json
import logging

from convert.store import LATEST, version_dirname
from trainer_jax.checkpoint import (
    _DropOrbaxErrors,
    _one_line,
    _orbax_errors_raised_not_logged,
)
from trainer_jax.resume import (
    DISCARDED,
    METRICS_DISCARDED,
    continue_versions,
    storage_failure,
    trim_metrics,
)


def _versions(d) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.is_dir() and p.name.startswith("v"))


def test_versions_past_the_checkpoint_are_set_aside_and_numbers_never_go_back(tmp_path):
    weights = tmp_path / "weights"
    for v in range(5):
        (weights / version_dirname(v)).mkdir(parents=True)
        (weights / version_dirname(v) / "manifest.json").write_text(str(v))
    (weights / LATEST).write_text(version_dirname(4) + "\n")
    (weights / DISCARDED / version_dirname(7)).mkdir(parents=True)  # set aside by an earlier resume
    # leftovers of a publish killed mid-write: removed; anything else is left alone
    (weights / f".{version_dirname(5)}.tmp-abc").mkdir()
    (weights / f".publish-{version_dirname(6)}-xyz").write_text("")
    (weights / f".{LATEST}.tmp-1").write_text("")
    (weights / "notes.txt").write_text("mine")

    first, moved = continue_versions(weights, 2)

    assert (first, moved) == (8, [3, 4])  # after the highest ever published (v7, discarded)
    assert _versions(weights) == [version_dirname(v) for v in range(3)]
    assert _versions(weights / DISCARDED) == [version_dirname(v) for v in (3, 4, 7)]
    assert (weights / DISCARDED / version_dirname(4) / "manifest.json").read_text() == "4"
    assert (weights / LATEST).read_text() == version_dirname(2) + "\n"
    assert sorted(p.name for p in weights.iterdir()) == sorted(
        [DISCARDED, LATEST, "notes.txt", *[version_dirname(v) for v in range(3)]])


def test_nothing_restored_sets_every_version_aside_and_drops_latest(tmp_path):
    weights = tmp_path / "weights"
    for v in (0, 1):
        (weights / version_dirname(v)).mkdir(parents=True)
    (weights / LATEST).write_text(version_dirname(1) + "\n")
    assert continue_versions(weights, None) == (2, [0, 1])
    assert not (weights / LATEST).exists() and _versions(weights) == []
    assert _versions(weights / DISCARDED) == [version_dirname(0), version_dirname(1)]
    # no weights directory yet: the numbers start after the checkpoint's version
    assert continue_versions(tmp_path / "none", 5) == (6, [])
    assert continue_versions(tmp_path / "none", None) == (0, [])


def test_metrics_past_the_restored_step_and_torn_lines_move_aside(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "lo')
    (tmp_path / METRICS_DISCARDED).write_text('{"step": 9}\n')  # an earlier resume's

    assert trim_metrics(tmp_path, 3) == 3
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(ln + "\n" for ln in lines[:3])
    assert (tmp_path / METRICS_DISCARDED).read_text() == \
        '{"step": 9}\n' + lines[3] + "\n" + lines[4] + '\n{"step": 6, "lo\n'

    # nothing to move: the file is left as it is; no step restored: every record moves
    assert trim_metrics(tmp_path, 3) == 0
    assert trim_metrics(tmp_path, None) == 3
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert trim_metrics(tmp_path / "no-run", 3) == 0


def test_only_storage_errors_stop_a_run():
    assert storage_failure(["publish v3: [Errno 2] No such file", "publish v4: [Errno 28] No space left"]) \
        == "publish v4: [Errno 28] No space left"
    assert storage_failure(["publish v3: [Errno 2] No such file", "timeout"]) is None
    assert storage_failure([]) is None


def _record(level: int, path: str) -> logging.LogRecord:
    return logging.LogRecord("absl", level, path, 1, "save failed", None, None)


def test_only_orbaxs_own_error_records_are_dropped_while_saving():
    # Orbax logs a failed save with its traceback before raising; the failure reaches the user
    # once, as CheckpointError's line. Everything else the absl logger gets while saving stays.
    orbax = "/venv/lib/python3.11/site-packages/orbax/checkpoint/_src/checkpointer.py"
    absl = logging.getLogger("absl")
    with _orbax_errors_raised_not_logged():
        (quiet,) = [f for f in absl.filters if isinstance(f, _DropOrbaxErrors)]
        assert not quiet.filter(_record(logging.ERROR, orbax))
        assert not quiet.filter(_record(logging.CRITICAL, orbax))
        assert quiet.filter(_record(logging.WARNING, orbax))
        assert quiet.filter(_record(logging.ERROR, "/work/main/trainer_jax/train.py"))
    assert not any(isinstance(f, _DropOrbaxErrors) for f in absl.filters)


def test_a_long_error_is_one_line_keeping_both_ends():
    # tensorstore's messages run long and end with the OS error: the line keeps both ends
    e = OSError("write failed:\n  " + "a" * 300 + "\n  " + "b" * 300 + " [Errno 28] No space left")
    line = _one_line(e)
    text = " ".join(str(e).split())
    assert line == f"OSError: {text[:200]} ... {text[-200:]}" and "\n" not in line
    assert line.startswith("OSError: write failed: aaa") and line.endswith("bbb [Errno 28] No space left")
    assert _one_line(ValueError("short\n  one")) == "ValueError: short one"

