"""`mixrl-sample` never waits silently (issue 45, items 2 and 6), run as the README writes it:

- nothing listening at ``--trainer``: ``waiting for the trainer at ADDR`` with the time so far
  every ``$MIXRL_WAIT_REPORT_S``, then one line after ``--connect-timeout-s``; SIGTERM meanwhile
  is a plain stop (exit 0), never ``trainer refused us: CANCELLED``;
- a trainer (a real rollout service) that goes away after the sampler registered: one line
  ``trainer at ADDR is gone`` and exit 1 within the ``--gone-after-s`` bound, and the trainer's
  registration line names the host, the processor's model and every recipe's kernels;
- ``--model-dir`` that does not exist, or holds a delta version: one line (the delta's names
  the ``mixrl-convert materialize`` command, which this test then runs as written).

The processes run side by side: each pays torch's import on a shared machine.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from convert.cli import main as convert_main
from convert.delta import DELTA_NAME
from convert.publish import publish
from sampler_torch.device import cpu_name
from trainer_jax.config import load_config
from trainer_jax.service import RolloutService
from trainer_jax.service.sessions import registration_line

BIN = Path(sys.executable).parent
TOKEN = "waits-token-0123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sample(out: Path, *args: str) -> subprocess.Popen:
    with open(out, "w") as f:
        return subprocess.Popen([BIN / "mixrl-sample", *args], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "MIXRL_TOKEN": TOKEN, "MIXRL_WAIT_REPORT_S": "1"})


def _wait_for(cond, timeout: float, proc: subprocess.Popen, what) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None and time.monotonic() < deadline, what()
        time.sleep(0.1)


def _waiting_lines(text: str, address: str) -> list[float]:
    return [float(m) for m in re.findall(rf"waiting for the trainer at {re.escape(address)} \((\d+) s so far",
                                         text)]


def test_mixrl_sample_says_what_it_waits_for_and_goes_when_the_trainer_does(tmp_path):
    from service.tiny import tiny_char_model

    nowhere, quiet = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    cfg = load_config(None, ["service.listen=127.0.0.1:0", "tasks.group_size=2", "service.heartbeat_s=0.3",
                             "tasks.sampling.max_new_tokens=4", "tasks.sampling.head_k=4"])
    svc = RolloutService.from_config(cfg, token=TOKEN).start()
    lines: list[str] = []
    svc.scheduler.on_register.append(lambda s: lines.append(registration_line(s)))
    model = tiny_char_model(tmp_path / "model")
    common = ["--group", "g", "--device", "cpu", "--threads", "1"]
    logs = {k: tmp_path / f"{k}.log" for k in ("timeout", "sigterm", "gone")}
    procs = {
        "timeout": _sample(logs["timeout"], "--trainer", nowhere, *common, "--connect-timeout-s", "3"),
        "sigterm": _sample(logs["sigterm"], "--trainer", quiet, *common),
        "gone": _sample(logs["gone"], "--trainer", svc.address, *common, "--model-dir", str(model),
                        "--recipe", "bf16", "--capacity", "2", "--gone-after-s", "3",
                        "--weights-cache", str(tmp_path / "cache"), "--name", "going"),
    }
    try:
        text = lambda k: logs[k].read_text()  # noqa: E731
        # SIGTERM once it says it waits: a plain stop.
        _wait_for(lambda: _waiting_lines(text("sigterm"), quiet), 120, procs["sigterm"],
                  lambda: text("sigterm"))
        procs["sigterm"].send_signal(signal.SIGTERM)
        assert procs["sigterm"].wait(30) == 0, text("sigterm")
        assert "CANCELLED" not in text("sigterm") and "refused" not in text("sigterm"), text("sigterm")
        assert "stopped before the trainer answered" in text("sigterm")

        assert procs["timeout"].wait(120) == 1, text("timeout")
        waited = _waiting_lines(text("timeout"), nowhere)
        assert waited and waited[0] <= 2 and max(waited) < 3, text("timeout")  # every ~1 s, then gives up
        last = text("timeout").strip().splitlines()[-1]
        assert last == (f"mixrl-sample: no trainer answered at {nowhere} within --connect-timeout-s 3 "
                        "(is it running, and is that its address and port?)"), text("timeout")
        assert "Traceback" not in text("timeout")

        # The sampler on the real service registers; the service then goes away.
        _wait_for(lambda: any(s["name"] == "going" for s in svc.status()["samplers"]), 120, procs["gone"],
                  lambda: text("gone"))
        svc.stop(grace=0)
        gone_at = time.monotonic()
        assert procs["gone"].wait(60) == 1, text("gone")
        took = time.monotonic() - gone_at
        assert took < 30, (took, text("gone"))
        tail = text("gone").strip().splitlines()
        assert re.fullmatch(rf"mixrl-sample: trainer at {re.escape(svc.address)} is gone \(unreachable "
                            r"for \d+ s\); exiting", tail[-1]), tail[-5:]
        assert "Traceback" not in text("gone")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)
        svc.stop(grace=0)
    # What the trainer's console says of it (trainer_jax.waits.announce_registrations).
    [line] = [x for x in lines if "going" in x]
    processor = cpu_name()
    assert processor and processor != "x86_64"
    assert line.startswith(f"sampler going registered: group g, recipe bf16, host 127.0.0.1, cpu "
                           f"{processor}, bf16 matmuls native (matmuls here: "), line
    assert "bf16:native" in line and "fp8:emulate" in line, line


def test_cpu_name_reads_the_model_not_the_architecture(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n"
                    "model name\t: Intel(R) Xeon(R)  Platinum 8480+\nflags\t\t: fpu\n\n"
                    "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n")
    assert cpu_name(str(info)) == "Intel(R) Xeon(R) Platinum 8480+"
    info.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU part\t: 0xd0c\n")  # an ARM kernel without one
    assert cpu_name(str(info)) == ""
    assert cpu_name(str(tmp_path / "absent")) == ""


def test_model_dir_missing_or_a_delta_version_is_one_line(tmp_path):
    from weight_versions import CFG, versions_of_weights

    root = tmp_path / "weights"
    for v, params in enumerate(versions_of_weights(2)):
        publish(params, CFG, root, v, ["bf16"], keep_last=None, delta=True)
    delta_dir = root / "v00000001" / "bf16"
    assert (delta_dir / DELTA_NAME).is_file()
    addr = f"127.0.0.1:{_free_port()}"
    runs = {"missing": _sample(tmp_path / "missing.log", "--trainer", addr, "--group", "g", "--model-dir",
                               str(tmp_path / "nope")),
            "delta": _sample(tmp_path / "delta.log", "--trainer", addr, "--group", "g", "--model-dir",
                             str(delta_dir))}
    for name, proc in runs.items():
        assert proc.wait(120) == 2, (tmp_path / f"{name}.log").read_text()
    missing = (tmp_path / "missing.log").read_text().strip()
    assert missing == (f"mixrl-sample: --model-dir {tmp_path / 'nope'}: no such directory (leave "
                       "--model-dir out to fetch the trainer's current weights)")
    [line] = (tmp_path / "delta.log").read_text().strip().splitlines()
    command = re.search(r"(mixrl-convert materialize --root \S+ --version \d+ --format \S+) --out DIR", line)
    assert line.startswith(f"mixrl-sample: --model-dir {delta_dir} is a delta version (v1 of bf16, stored "
                           "as changes against v0)") and command, line
    # The command as the line writes it turns the delta into a full directory.
    out = tmp_path / "full"
    assert convert_main([*command.group(1).split()[1:], "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and not (out / DELTA_NAME).exists()
    # mixrl-train serve pointed at the same delta version names the same command, in one line.
    serve = subprocess.run([BIN / "mixrl-train", "serve", "--listen", "127.0.0.1:0", "--weights-dir",
                            str(root / "v00000001"), "--status-every", "0"], capture_output=True, text=True,
                           timeout=300, stdin=subprocess.DEVNULL, env={**os.environ, "MIXRL_TOKEN": "t"})
    errors = [ln for ln in serve.stderr.splitlines() if ln.strip()]
    assert serve.returncode == 2 and len(errors) == 1, serve.stderr
    assert "is a delta version (v1 of bf16" in errors[0] and command.group(1) in errors[0], errors[0]
