"""The trainer says what it waits for and who joined (issue 45, items 2, 3 and 6).

End to end, as the README runs it: a ``mixrl-train`` whose groups are all ``spawn: false``
prints, every ``$MIXRL_WAIT_REPORT_S``, each group's registered samplers and what it lacks; an
external ``mixrl-sample`` started without ``--model-dir`` fetches the current version, and its
registration is a line in the trainer's console; the warm start, redirected to a file, prints
plain progress lines; when the run ends the external sampler leaves in one line. In process:
the take timeout's error names the counts (and that no sampler ever registered), ``Phase``'s
plain lines, library warnings as console lines, and prices the config says are illustrative.
"""

from __future__ import annotations

import io
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from sampler_torch.client import Backoff, RolloutClient
from trainer_jax.config import load_config
from trainer_jax.console_log import ConsoleHandler, console_logging
from trainer_jax.cost import illustrative_line, illustrative_prices
from trainer_jax.progress import Phase
from trainer_jax.samplers import LocalSamplers
from trainer_jax.service import RolloutService
from trainer_jax.waits import announce_registrations, take

BIN = Path(sys.executable).parent
CONFIG = """
run: {name: waits, seed: 0, steps: 1}
model: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2,
        num_key_value_heads: 1, head_dim: 16}
sft: {steps: 12, sequences_per_step: 8, rows: 4, row_len: 64, max_tokens: 128}
tasks: {env: arithmetic, group_size: 2, sampling: {temperature: 1.0, head_k: 4, max_new_tokens: 6}}
service: {listen: "127.0.0.1:PORT", buffer: {max_trajectories: 8}}  # 4 steps' worth (tests/loop_configs.py)
groups:
  - {name: ext, recipe: bf16, spawn: false}
  - {name: h100-fp8, recipe: fp8, spawn: false}
train: {prompts_per_step: 1, publish_every: 1, checkpoint_every: 1000, eval_every: 0, eval_tasks: 0,
        rows: 2, row_len: 32, max_tokens: 32, support_k: 4, episode_tokens: 32, take_timeout_s: 240}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(600)
def test_a_trainer_of_external_groups_says_what_it_waits_for_and_who_joined(tmp_path):
    port = _free_port()
    address = f"127.0.0.1:{port}"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.replace("PORT", str(port)))
    run_dir, out, log = tmp_path / "run", tmp_path / "trainer.log", tmp_path / "ext.log"
    # Reports every 0.1 s: the warm start (12 tiny steps from the compilation cache) took under
    # a second on CI, and a phase shorter than the period rightly prints no progress line.
    env = {**os.environ, "MIXRL_WAIT_REPORT_S": "0.1"}
    with open(out, "w") as f:  # a file, not a terminal: the plain lines, not rich's spinner
        trainer = subprocess.Popen([BIN / "mixrl-train", "--config", cfg, "--run-dir", run_dir],
                                   stdout=f, stderr=subprocess.STDOUT, env=env)
    sampler = None
    text = lambda: out.read_text()  # noqa: E731
    try:
        deadline = time.monotonic() + 400
        while "group h100-fp8: 0 samplers registered" not in text():
            assert trainer.poll() is None and time.monotonic() < deadline, text()[-3000:]
            time.sleep(0.2)
        # The README's external sampler: no --model-dir, the run's token file.
        with open(log, "w") as f:
            sampler = subprocess.Popen(
                [BIN / "mixrl-sample", "--trainer", address, "--group", "ext", "--recipe", "bf16",
                 "--token-file", run_dir / "token", "--name", "ext-0", "--capacity", "2", "--threads", "1",
                 "--episode-tokens", "32", "--weights-cache", tmp_path / "cache", "--device", "cpu",
                 "--gone-after-s", "5"], stdout=f, stderr=subprocess.STDOUT, env=env)
        assert trainer.wait(400) == 0, text()[-3000:] + log.read_text()[-2000:]
        assert sampler.wait(60) == 1, log.read_text()[-3000:]  # the trainer is gone: one line, exit 1
    finally:
        for proc in (trainer, sampler):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)
    console, ext = text(), log.read_text()
    # The waits, per group, while no sampler was there.
    assert "group ext: 0 samplers registered (spawn: false — start them with mixrl-sample --trainer " \
           f"{address} --group ext --recipe bf16 ... or mixrl-fleet up)" in console, console
    assert "group h100-fp8: 0 samplers registered (spawn: false — start them with mixrl-sample " \
           f"--trainer {address} --group h100-fp8 --recipe fp8 ... or mixrl-fleet up)" in console
    assert re.search(r"waiting \d+s for 1 complete prompt groups \(have 0, 0 more ready; "
                     r"train.take_timeout_s=240\):", console), console
    # The warm start off a terminal: plain lines with done / total, rate and ETA.
    assert re.search(r"supervised warm start: \d+/12 steps, [\d.e+-]+ steps/s, ETA [\d:?]+ "
                     r"\[\d+:\d\d elapsed\]", console), console
    # The external sampler fetched its first weights and is one line in the trainer's console.
    assert "no --model-dir: fetching the current weights from the trainer at" in ext, ext
    assert re.search(r"starting from the trainer's version 0 \(\S+/cache/initial/\S+\)", ext), ext
    registered = [x for x in console.splitlines() if x.startswith("sampler ext-0 registered:")]
    assert registered and registered[0].startswith(
        "sampler ext-0 registered: group ext, recipe bf16, host 127.0.0.1, cpu "), console
    assert "bf16 matmuls native (matmuls here: " in registered[0] and "x86_64" not in registered[0]
    assert "WARNING:" not in console and "Traceback" not in console
    assert re.search(rf"mixrl-sample: trainer at {address} is gone \(unreachable for \d+ s\); exiting\n*$",
                     ext), ext[-2000:]


def test_take_timeout_names_the_counts_and_that_none_ever_registered(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("groups:\n  - {name: h100-fp8, recipe: fp8, spawn: false}\n"
                    "  - {name: a100-bf16, recipe: bf16, spawn: false}\n")
    cfg = load_config(path, ["service.listen=127.0.0.1:0", "tasks.group_size=2", "train.take_timeout_s=2",
                             "tasks.sampling.max_new_tokens=4", "tasks.sampling.head_k=4"])
    svc = RolloutService.from_config(cfg, token="t" * 16).start()
    lines: list[str] = []
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            take(svc, LocalSamplers(cfg, tmp_path), cfg, 2, print_line=lines.append, every_s=0.5)
        assert 2 <= time.monotonic() - t0 < 5
    finally:
        svc.stop(grace=0)
    assert str(e.value) == ("no 2 complete prompt groups within train.take_timeout_s=2s (got 0); registered "
                            "samplers per group: h100-fp8=0 a100-bf16=0; no sampler ever registered")
    waits = [x for x in lines if x.startswith("waiting ")]
    assert len(waits) >= 2, lines  # every 0.5 s
    assert re.fullmatch(r"waiting [01]s for 2 complete prompt groups \(have 0, 0 more ready; "
                        r"train.take_timeout_s=2\):", waits[0]), lines
    assert ("  group h100-fp8: 0 samplers registered (spawn: false — start them with mixrl-sample "
            f"--trainer {svc.address} --group h100-fp8 --recipe fp8 ... or mixrl-fleet up)") in lines, lines


def test_counts_after_a_registration(tmp_path):
    cfg = load_config(None, ["service.listen=127.0.0.1:0", "tasks.group_size=2", "train.take_timeout_s=1",
                             "tasks.sampling.max_new_tokens=4", "tasks.sampling.head_k=4"])
    svc = RolloutService.from_config(cfg, token="t" * 16).start()
    seen: list[str] = []
    announce_registrations(svc, cfg, seen.append)
    first = cfg.groups[0]
    client = RolloutClient(svc.address, "t" * 16, group=first.name, name="s-1", capacity=2,
                           backoff=Backoff(initial_s=0.01, max_s=0.1), max_retry_s=5.0)
    try:
        client.register()
        with pytest.raises(TimeoutError) as e:
            take(svc, LocalSamplers(cfg, tmp_path), cfg, 10_000, print_line=seen.append, every_s=0.3)
    finally:
        client.close()
        svc.stop(grace=0)
    others = " ".join(f"{g.name}={1 if g.name == first.name else 0}" for g in cfg.groups)
    assert str(e.value).endswith(f"registered samplers per group: {others}"), e.value
    assert any(x.startswith(f"sampler s-1 registered: group {first.name}, recipe ") for x in seen), seen
    assert any(f"group {first.name}: 1 of {first.processes} spawned samplers registered" in x
               for x in seen), seen


def test_phase_prints_plain_lines_off_a_terminal():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, soft_wrap=True)
    with Phase(console, "supervised warm start", total=10, every_s=0.3) as phase:
        for step in range(4):
            phase.update(step + 1, f"loss {1.0 / (step + 1):.3f}")
            time.sleep(0.25)
    lines = buf.getvalue().splitlines()
    assert len(lines) >= 2, lines  # ~1 s at one line per 0.3 s
    for line in lines:
        m = re.fullmatch(r"supervised warm start: (\d+)/10 steps, ([\d.]+) steps/s, ETA (\d+:\d\d) "
                         r"\[0:0\d elapsed\]; loss [\d.]+", line)
        assert m, line
        assert 1 <= int(m.group(1)) <= 4 and 1 < float(m.group(2)) < 10
    with Phase(console, "samplers registering", status=lambda: "1 of 2 registered", every_s=0.2):
        time.sleep(0.5)
    assert re.search(r"samplers registering: 0:0\d elapsed; 1 of 2 registered", buf.getvalue())
    quiet = io.StringIO()
    with Phase(Console(file=quiet, force_terminal=False), "fast", every_s=0.5):
        pass  # done before its first line is due: says nothing
    assert quiet.getvalue() == ""


def test_library_warnings_print_like_console_lines():
    """absl's ``basicConfig()`` output (``WARNING:name:msg``) is replaced by a console line."""
    code = """
import io, logging
from rich.console import Console
from trainer_jax.console_log import console_logging
logging.basicConfig()  # what absl does on its first record
buf = io.StringIO()
console_logging(Console(file=buf, force_terminal=False, soft_wrap=True))
logging.getLogger("mixrl.service").warning("sampler x (group g): [not markup] priced as %s", "H100")
logging.getLogger("mixrl.service").info("not shown at the root's level")
logging.getLogger("other").error("boom")
print(buf.getvalue(), end="")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["warning: sampler x (group g): [not markup] priced as H100",
                                        "error: boom"], done.stdout
    assert done.stderr == "", done.stderr
    # In process, a handler someone configured on purpose (pytest's capture) is kept; an earlier
    # run's ConsoleHandler (an in-process trainer test on the same xdist worker) is replaced.
    root = logging.getLogger()
    on_purpose = logging.Handler()
    root.addHandler(on_purpose)
    earlier = console_logging(Console(file=io.StringIO()))
    handler = console_logging(Console(file=io.StringIO()))
    try:
        assert on_purpose in root.handlers
        assert earlier not in root.handlers and handler in root.handlers
        assert sum(isinstance(h, ConsoleHandler) for h in root.handlers) == 1
    finally:
        root.removeHandler(handler)
        root.removeHandler(on_purpose)


def test_the_demo_configs_prices_are_said_once_as_illustrative(caplog):
    cfg = load_config("configs/local_mixed.yaml", ["service.listen=127.0.0.1:0"])
    priced = illustrative_prices(cfg.groups)
    assert priced == {"bf16": "H100", "fp8": "H100", "nvfp4": "B200", "mxfp4": "RTXPRO6000"}
    line = illustrative_line(cfg.groups)
    assert line.startswith("prices are illustrative: groups priced bf16 as H100, fp8 as H100, nvfp4 as B200")
    svc = RolloutService.from_config(cfg, token="t" * 16).start()
    seen: list[str] = []
    announce_registrations(svc, cfg, seen.append)
    # A group of the same price key whose samplers may land anywhere (device auto) still warns.
    svc.accelerators["extra"] = "H100"
    cpu = {"type": "cpu", "name": "AMD EPYC", "kernels": {"bf16": "native"}}
    clients = [RolloutClient(svc.address, "t" * 16, group=g, name=f"{g}-0", device=cpu, max_retry_s=5.0,
                             backoff=Backoff(initial_s=0.01, max_s=0.1)) for g in ("bf16", "extra")]
    try:
        with caplog.at_level(logging.INFO, logger="mixrl.service"):
            for c in clients:
                c.register()
    finally:
        for c in clients:
            c.close()
        svc.stop(grace=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["sampler extra-0 (group extra): priced as accelerator 'H100' but reports cpu "
                        "AMD EPYC"]
    assert seen[0] == line and len([x for x in seen if "registered:" in x]) == 2, seen
