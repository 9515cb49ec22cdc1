"""Fault injection on the real trainer: SIGKILL at a named moment, then ``--resume``.

Every run here is a real ``mixrl-train`` process with a real ``mixrl-sample`` child. The trainer
is frozen at an exact point with ``MIXRL_FAULT_POINT`` (it SIGSTOPs itself there, every thread at
once, see ``trainer_jax.faults``) and the test then sends SIGKILL, or lowers its file-size limit
and lets it continue (a disk that fills up). Each check reads the run directory afterwards: what
resumed from where, which versions exist, which processes are still alive.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from procs import proc_state

from convert.publish import latest_version, list_versions
from convert.verify import VerifyReport, verify_version
from sampler_torch.client import RolloutClient
from trainer_jax.checkpoint import verify_manifest

BIN = Path(sys.executable).parent
CONFIG = """
run: {name: crash, seed: 0, steps: 8}
model: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2,
        num_key_value_heads: 1, head_dim: 16}
sft: {steps: 0}  # no warm start, no start/end evaluation: the crashes are what is tested
tasks:
  env: mix
  group_size: 2
  sampling: {temperature: 1.0, head_k: 4, max_new_tokens: 6}
  mix: [{env: arithmetic, difficulty: 1}]
service: {listen: "127.0.0.1:PORT", buffer: {max_trajectories: 16}}  # 4 steps' worth (tests/loop_configs.py)
groups:
  - {name: bf16, recipe: bf16, capacity: 4, threads: 1}
EXTRA
train: {prompts_per_step: 2, publish_every: 1, checkpoint_every: 2, eval_every: 0, eval_tasks: 0,
        rows: 4, row_len: 32, max_tokens: 64, support_k: 4, episode_tokens: 32,
        take_timeout_s: 240, keep_checkpoints: KEEP}
"""
VERSION_LOADED = re.compile(r"weights version (\d+) \(\w+\) verified and loaded")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp_path: Path, *, external: bool = False, keep_checkpoints: int = 2) -> tuple[Path, int]:
    port = _free_port()
    extra = "  - {name: ext, recipe: bf16, spawn: false}" if external else ""
    path = tmp_path / "crash.yaml"
    path.write_text(CONFIG.replace("PORT", str(port)).replace("EXTRA", extra)
                    .replace("KEEP", str(keep_checkpoints)))
    return path, port


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_frozen_trainer_left():
    """A failed assertion must not leave a trainer stopped at its fault point (nor its samplers)."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


class Trainer:
    """A ``mixrl-train`` process whose output lines are kept with the time they arrived."""

    def __init__(self, cfg: Path, run_dir: Path, *extra: str, fault: str | None = None,
                 hold: str | None = None):
        env = dict(os.environ)
        self.marker = run_dir.parent / f"fault-{time.monotonic_ns()}"
        self.hold_marker = Path(f"{self.marker}.hold")
        if fault or hold:
            env.update(MIXRL_FAULT_POINT=fault or "", MIXRL_FAULT_HOLD=hold or "",
                       MIXRL_FAULT_MARKER=str(self.marker))
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [BIN / "mixrl-train", "--config", cfg, "--run-dir", run_dir, *extra], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _STARTED.append(self.proc)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic() - self.t0, line.rstrip("\n")))
            if os.environ.get("DBG"):
                print(f"[{self.lines[-1][0]:7.2f}] {line.rstrip()}", flush=True)

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def _wait_marker(self, marker: Path, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not marker.exists():
            assert self.proc.poll() is None, f"trainer exited:\n{self.output[-3000:]}"
            assert time.monotonic() < deadline, f"{what} not reached:\n{self.output[-3000:]}"
            time.sleep(0.1)

    def wait_frozen(self, timeout: float = 240) -> None:
        """Until the trainer stopped itself at its fault point."""
        self._wait_marker(self.marker, "fault point", timeout)
        # The marker is written just before the SIGSTOP the process sends itself: allow it to land.
        deadline = time.monotonic() + 10
        while proc_state(self.proc.pid) != "T":
            assert time.monotonic() < deadline, "the trainer should be stopped at its fault point"
            time.sleep(0.01)

    def wait_held(self, timeout: float = 240) -> None:
        """Until the trainer's main thread holds at its hold point (the service keeps serving)."""
        self._wait_marker(self.hold_marker, "hold point", timeout)

    def release(self) -> None:
        self.hold_marker.unlink()

    def wait(self, timeout: float = 300) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:  # stuck: its threads' stacks say on what (cli.py, SIGUSR1)
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(3)
            pytest.fail(f"trainer still running after {timeout} s:\n{self.output[-12000:]}")
        self._reader.join(10)
        return rc

    def kill(self) -> float:
        """SIGKILL; the moment it was sent."""
        t = time.monotonic()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(10)
        return t

    def line_time(self, pattern: str) -> float:
        return next(t for t, line in self.lines if re.search(pattern, line))


def _spawned_by(trainer_pid: int) -> list[int]:
    """The samplers a trainer started (their command line names it with --exit-with-parent)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            args = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--exit-with-parent" in args and str(trainer_pid).encode() in args:
            pids.append(int(d.name))
    return pids


def _wait_gone(pids: list[int], since: float, timeout: float = 60) -> float:
    """Seconds from ``since`` until every pid exited (zombies count as exited)."""
    while any(proc_state(p) not in (None, "Z") for p in pids):
        assert time.monotonic() - since < timeout, f"still alive {timeout}s after the kill: {pids}"
        time.sleep(0.05)
    return time.monotonic() - since


def _kill_and_check_orphans(trainer: Trainer) -> float:
    samplers = _spawned_by(trainer.proc.pid)
    assert samplers, "the trainer should have spawned its sampler"
    return _wait_gone(samplers, trainer.kill())


def _steps(run_dir: Path) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "loss" in r]


def _all_versions(weights: Path) -> list[int]:
    return sorted(list_versions(weights) + list_versions(weights / "discarded"))


def _check_published(weights: Path) -> None:
    """Nothing half-written is visible: no temp names, LATEST exists, every version verifies."""
    assert not [p.name for p in weights.iterdir()
                if ".tmp-" in p.name or ".old-" in p.name or p.name.startswith(".publish-v")]
    latest = latest_version(weights)
    assert latest is not None and latest.is_dir(), f"LATEST names {latest}"
    for v in list_versions(weights):  # deltas included: each checked as the directory it makes
        results = verify_version(weights / f"v{v:08d}")
        assert results and all(isinstance(r, VerifyReport) for r in results.values()), results


FIGURES: dict[str, float] = {}


def _figure(name: str, value: float) -> None:
    FIGURES[name] = round(value, 2)
    print(f"figure {name}: {value:.2f} s", flush=True)


def _truncate_largest_data_file(step_dir: Path) -> None:
    data = max((p for p in step_dir.rglob("*") if p.is_file() and "/d/" in p.as_posix()),
               key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


@pytest.mark.timeout(900)
def test_kill_during_learner_step_corrupt_checkpoints_and_a_sampler_holding_newer_weights(tmp_path):
    cfg, port = _config(tmp_path, external=True, keep_checkpoints=3)
    run_dir = tmp_path / "run"
    weights, checkpoints = run_dir / "weights", run_dir / "checkpoints"
    # Held before step 1's update until the external sampler has joined (a trainer whose steps
    # compile from cache can reach step 8 before a sampler process has even imported torch),
    # then frozen before step 8's update.
    first = Trainer(cfg, run_dir, fault="learner_step:8", hold="learner_step:1")
    # An external sampler joins by address (not spawned: it must survive the trainer's death).
    deadline = time.monotonic() + 240
    while not ((run_dir / "token").is_file() and (weights / "v00000000" / "bf16").is_dir()):
        assert first.proc.poll() is None and time.monotonic() < deadline, first.output[-3000:]
        time.sleep(0.2)
    model_dir = tmp_path / "ext-model"
    shutil.copytree(weights / "v00000000" / "bf16", model_dir)
    ext_log = tmp_path / "ext.log"
    with open(ext_log, "w") as log:
        ext = subprocess.Popen(
            [BIN / "mixrl-sample", "--trainer", f"127.0.0.1:{port}", "--group", "ext", "--recipe", "bf16",
             "--model-dir", model_dir, "--token-file", run_dir / "token", "--capacity", "2", "--threads", "1",
             "--episode-tokens", "32", "--weights-transfer", "shared", "--name", "ext-0",
             "--weights-cache", tmp_path / "ext-cache"], stdout=log, stderr=subprocess.STDOUT)
    try:
        first.wait_held()
        with RolloutClient(f"127.0.0.1:{port}", (run_dir / "token").read_text().strip(),
                           group="ext") as client:
            deadline = time.monotonic() + 240
            while "ext-0" not in [s.name for s in client.status().samplers]:
                assert ext.poll() is None and time.monotonic() < deadline, ext_log.read_text()[-3000:]
                time.sleep(0.2)
        first.release()
        first.wait_frozen()
        assert sorted(os.listdir(checkpoints), key=int) == ["2", "4", "6"]

        def loaded() -> list[int]:
            return [int(v) for v in VERSION_LOADED.findall(ext_log.read_text())]

        # The sampler reads weights from disk itself: it finishes loading what was announced to
        # it while the trainer is frozen. Five steps after v3 it holds v3 or newer.
        deadline = time.monotonic() + 60
        while max(loaded(), default=-1) < 3:
            assert time.monotonic() < deadline, ext_log.read_text()[-3000:]
            time.sleep(0.2)
        held = max(loaded())
        published = _all_versions(weights)
        _figure("learner_step: spawned samplers gone after SIGKILL", _kill_and_check_orphans(first))
        assert ext.poll() is None, "a sampler that joined by address keeps retrying"
        # The two newest checkpoints are damaged: a data file cut short, a meta rewritten.
        _truncate_largest_data_file(checkpoints / "6")
        (checkpoints / "4" / "meta" / "metadata").write_text(
            (checkpoints / "4" / "meta" / "metadata").read_text().replace('"step": 4', '"step": 9'))

        # Held before its last update (step 4) until the external sampler has loaded a version
        # the resumed run published: once the run has ended nothing would announce one to it.
        resumed = Trainer(cfg, run_dir, "--resume", "--steps", "4", hold="learner_step:2")
        resumed.wait_held()
        deadline = time.monotonic() + 60
        while not any(v > max(published) for v in loaded()):
            assert time.monotonic() < deadline, ext_log.read_text()[-3000:]
            time.sleep(0.2)
        resumed.release()
        assert resumed.wait() == 0, resumed.output[-4000:]
        out = resumed.output
        for step in (6, 4):  # one line each, newest first, naming the checkpoint
            assert re.search(rf"^checkpoint \S+/checkpoints/{step} is corrupt: .*; moved to corrupt-{step}, "
                             r"trying the previous one$", out, re.M), out[-3000:]
        assert re.search(r"^resumed from step 2 \(checkpoint \S+/checkpoints/2, weights v2\)$", out, re.M)
        _figure("learner_step: --resume until restored", resumed.line_time("resumed from step"))
        _figure("learner_step: --resume run in all", resumed.lines[-1][0])
        assert _steps(run_dir) == [1, 2, 3, 4]  # the killed run's steps 3..7 went aside
        # Every version the killed run published after v2 was set aside; the resumed run's are
        # all past anything ever published, so the external sampler took them as new.
        assert {v for v in published if v > 2} <= set(list_versions(weights / "discarded"))
        new = [v for v in list_versions(weights) if v > 2]
        assert new and min(new) > max(published) >= held > 2
        _check_published(weights)
    finally:
        ext.terminate()
        ext.wait(30)


@pytest.mark.timeout(900)
def test_kill_during_publication_then_during_checkpoint_then_resume(tmp_path):
    cfg, _ = _config(tmp_path)
    run_dir = tmp_path / "run"
    weights, checkpoints = run_dir / "weights", run_dir / "checkpoints"

    first = Trainer(cfg, run_dir, fault="publish:3")  # the third version half written
    first.wait_frozen()
    torn = [p.name for p in weights.iterdir() if re.match(r"\.v\d+\.tmp-", p.name)]
    assert len(torn) == 1, "one version should be mid-write"
    _figure("publish: spawned samplers gone after SIGKILL", _kill_and_check_orphans(first))
    assert latest_version(weights).is_dir()
    published = _all_versions(weights)

    second = Trainer(cfg, run_dir, "--resume", fault="checkpoint:1")  # step 4's save, in flight
    second.wait_frozen()
    assert "resumed from step 2 " in second.output
    assert [p for p in checkpoints.iterdir() if p.name.startswith("4.orbax-checkpoint-tmp")]
    assert torn[0] not in os.listdir(weights)  # the torn version's temp directory was cleared
    before = _all_versions(weights)
    # A torn version never existed for any sampler: numbering continues after the last complete one.
    assert min(set(before) - set(published)) == max(published) + 1
    _figure("checkpoint: spawned samplers gone after SIGKILL", _kill_and_check_orphans(second))

    third = Trainer(cfg, run_dir, "--resume", "--steps", "5")
    assert third.wait() == 0, third.output[-4000:]
    out = third.output
    assert re.search(r"interrupted checkpoint \S+/4\.orbax-checkpoint-tmp\S* \(never committed\) "
                     r"removed", out), out
    assert "resumed from step 2 " in out, out[-3000:]
    _figure("checkpoint: --resume run in all", third.lines[-1][0])
    assert _steps(run_dir) == [1, 2, 3, 4, 5]
    assert sorted(os.listdir(checkpoints)) == ["4", "5"]
    new = [v for v in list_versions(weights) if v > 2]
    assert new and min(new) > max(before)  # never a number the killed runs used
    _check_published(weights)


@pytest.mark.timeout(900)
def test_disk_full_during_publication_and_during_checkpoint(tmp_path):
    cfg, _ = _config(tmp_path)
    run_dir = tmp_path / "run"
    weights, checkpoints = run_dir / "weights", run_dir / "checkpoints"

    def fill_disk_and_continue(trainer: Trainer) -> None:
        # The samplers were started before: only the trainer hits the limit, as on a full disk.
        resource.prlimit(trainer.proc.pid, resource.RLIMIT_FSIZE, (1024, 1024))
        os.kill(trainer.proc.pid, signal.SIGCONT)

    def check_stopped(trainer: Trainer) -> None:
        samplers = _spawned_by(trainer.proc.pid)
        assert trainer.wait(240) == 1, trainer.output[-3000:]
        errors = [line for _, line in trainer.lines if line.startswith("error:")]
        assert errors and "File too large" in errors[-1], trainer.output[-3000:]
        assert trainer.lines[-1][1] == errors[-1], "the error is the run's last word"
        # Orbax's own threads may log their failure first, as an error line of their own (one
        # named "[process=0][thread=array_type_handler]", CI load); no other error line, and no
        # traceback runs through our code.
        assert all("[thread=" in e for e in errors[:-1]), errors
        assert not re.search(r'File ".*/(trainer_jax|convert)/', trainer.output), trainer.output[-3000:]
        _wait_gone(samplers, time.monotonic(), 30)
        _check_published(weights)
        assert not [p for p in checkpoints.iterdir() if "tmp" in p.name]
        for step in os.listdir(checkpoints):
            assert verify_manifest(checkpoints / step) is None

    first = Trainer(cfg, run_dir, fault="publish:2")
    first.wait_frozen()
    fill_disk_and_continue(first)
    check_stopped(first)
    assert os.listdir(checkpoints) == ["2"] or os.listdir(checkpoints) == []

    second = Trainer(cfg, run_dir, "--resume", fault="checkpoint:1")
    second.wait_frozen()
    fill_disk_and_continue(second)
    check_stopped(second)


# A stand-in trainer: starts one child in its own session (as trainer_jax.samplers does), prints
# the child's pid and waits to be killed. The child arms the parent watch, says so, then sleeps.
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""
_CHILD = """
import os, signal, time
from sampler_torch.parent_watch import exit_with_parent
if {ignore_term}:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
exit_with_parent(os.getppid(), interval_s=0.2, grace_s=1.0, use_pdeathsig={pdeathsig})
print("armed", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("pdeathsig, ignore_term, within_s", [
    (True, False, 3.0),    # the kernel's parent-death signal
    (False, False, 3.0),   # the watchdog alone (no prctl)
    (False, True, 5.0),    # a child that ignores SIGTERM is SIGKILLed after the grace period
])
def test_spawned_child_exits_when_its_parent_is_killed(pdeathsig, ignore_term, within_s):
    child_code = _CHILD.format(ignore_term=ignore_term, pdeathsig=pdeathsig)
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, child_code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "armed"  # the child shares the parent's stdout
        assert proc_state(child) not in (None, "Z")
        parent.kill()
        parent.wait(10)
        assert _wait_gone([child], time.monotonic(), within_s) < within_s
    finally:
        parent.kill()
        parent.wait(10)


def test_corrupt_checkpoint_is_named_set_aside_and_the_previous_one_restored(tmp_path):
    from convert.qwen3_config import Qwen3Config
    from trainer_jax.checkpoint import Checkpointer, CheckpointError
    from trainer_jax.learner import Learner, OptimizerConfig
    from trainer_jax.models import init_model
    from trainer_jax.objective import ObjectiveConfig

    qcfg = Qwen3Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    learner = Learner(init_model(qcfg, seed=0), OptimizerConfig(), ObjectiveConfig())
    ckpt = Checkpointer(tmp_path / "c", keep_last=3)
    for step in (1, 2, 3):
        ckpt.save(step, learner.model, learner.optimizer, {"step": step})
    ckpt.close()
    # Step 3: a data file cut short (a disk that lost the tail); step 2: its meta overwritten.
    _truncate_largest_data_file(tmp_path / "c" / "3")
    (tmp_path / "c" / "2" / "meta" / "metadata").write_text('{"step": 9}')  # same size

    lines: list[str] = []
    ckpt = Checkpointer(tmp_path / "c", log=lines.append)
    assert ckpt.restore(learner.model, learner.optimizer) == {"step": 1}
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"checkpoint {tmp_path / 'c' / '3'} is corrupt: ") and "truncated" in lines[0]
    assert lines[1].startswith(f"checkpoint {tmp_path / 'c' / '2'} is corrupt: ") and "sha256" in lines[1]
    assert sorted(os.listdir(tmp_path / "c")) == ["1", "corrupt-2", "corrupt-3"]
    # The resumed run saves step numbers past the restored one again without a clash.
    ckpt.save(2, learner.model, learner.optimizer, {"step": 2})
    ckpt.close()

    (tmp_path / "c" / "1" / "meta" / "metadata").write_text("{")
    (tmp_path / "c" / "2" / "meta" / "metadata").write_text("{")
    with pytest.raises(CheckpointError, match=r"^no readable checkpoint in \S+ \(tried steps 2, 1\)$"):
        Checkpointer(tmp_path / "c").restore(learner.model, learner.optimizer)
