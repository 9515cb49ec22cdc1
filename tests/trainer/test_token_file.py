"""``service.token_file`` honoured by ``mixrl-train`` (issue 30, item 3): the file's token when it
exists, else a new one written there (0600, parent directories created, never half-written);
spawned and external samplers use that file; ``--resume`` keeps it; no token_file: ``<run>/token``
as before. An empty or unreadable file is one line at start."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer_jax.config import ConfigError, load_config
from trainer_jax.service.auth import (
    TokenError,
    ensure_token_file,
    read_token_file,
    resolve_token,
    write_token_file,
)

BIN = Path(sys.executable).parent
CONFIG = """
run: {name: tok, seed: 0, steps: 1}
model: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2,
        num_key_value_heads: 1, head_dim: 16}
sft: {steps: 0}
tasks: {env: arithmetic, group_size: 2, sampling: {temperature: 1.0, head_k: 4, max_new_tokens: 6}}
service: {listen: "127.0.0.1:PORT", token_file: TOKEN, buffer: {max_trajectories: 8}}
groups:
  - {name: ext, recipe: bf16, spawn: false}
train: {prompts_per_step: 1, publish_every: 1, checkpoint_every: 1000, eval_every: 0, eval_tasks: 0,
        rows: 2, row_len: 32, max_tokens: 32, support_k: 4, episode_tokens: 32, take_timeout_s: 240}
"""


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_token_file_helpers(tmp_path):
    path = tmp_path / "a" / "b" / "token"
    assert read_token_file(path) is None
    token = ensure_token_file(path)  # missing: created, parents too, 0600
    assert len(token) >= 32 and _mode(path) == 0o600 and read_token_file(path) == token
    assert resolve_token(path) == token  # what `mixrl-train serve` and `mixrl-sample` read
    assert ensure_token_file(path) == token  # existing: used, not replaced
    assert write_token_file(path, "other", replace=False) == token and read_token_file(path) == token
    assert write_token_file(path, "other") == "other" and read_token_file(path) == "other"
    assert [p.name for p in path.parent.iterdir()] == ["token"]  # no temporary file left
    path.write_text(" \n")
    with pytest.raises(TokenError, match="is empty"):
        read_token_file(path)


def _trainer(tmp_path: Path, *overrides: str, resume: bool = False):
    from trainer_jax.train import Trainer

    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "sft.steps=0", *overrides])
    return Trainer(cfg, resume=resume)


def test_trainer_uses_creates_and_keeps_the_token_file(tmp_path):
    configured = tmp_path / "secrets" / "fleet" / "token"
    first = _trainer(tmp_path, f"service.token_file={configured}")
    assert first.token_file == configured and _mode(configured) == 0o600
    assert read_token_file(configured) == first.token
    # A fresh run (not --resume) uses the file's token: samplers given the file keep working.
    (tmp_path / "run" / "summary.json").write_text("{}")  # an earlier run, set aside
    # An existing file is only read: it may sit on a read-only secret mount. An immutable
    # directory stands in for one (root ignores mode bits, not the immutable flag).
    immutable = subprocess.run(["chattr", "+i", str(configured.parent)],
                               capture_output=True).returncode == 0
    try:
        again = _trainer(tmp_path, f"service.token_file={configured}")
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(configured.parent)], check=True)
    assert again.token == first.token and read_token_file(configured) == first.token
    assert not (tmp_path / "run" / "token").exists()
    # A token file inside the run directory survives the set-aside with its token.
    inside = tmp_path / "run" / "token.secret"
    inside.write_text("kept-token\n")
    (tmp_path / "run" / "summary.json").write_text("{}")
    moved = _trainer(tmp_path, f"service.token_file={inside}")
    assert moved.token == "kept-token" and read_token_file(inside) == "kept-token"

    # Without token_file: <run>/token, fresh per run, kept by --resume.
    plain = _trainer(tmp_path)
    run_token = tmp_path / "run" / "token"
    assert plain.token_file == run_token and read_token_file(run_token) == plain.token
    assert _mode(run_token) == 0o600
    assert _trainer(tmp_path, resume=True).token == plain.token
    assert _trainer(tmp_path).token != plain.token


def test_empty_token_file_is_one_line_before_anything_starts(tmp_path):
    from trainer_jax.train import train

    token = tmp_path / "token"
    token.write_text("\n")
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"service.token_file={token}"])
    # train() refuses it before jax.distributed, the mesh or the run directory (cli.py prints the
    # ConfigError as one `error:` line and exits 2).
    with pytest.raises(ConfigError, match=f"^service.token_file: token file {token} is empty"):
        train(cfg)
    assert not (tmp_path / "run").exists()
    token.chmod(0)
    if os.geteuid() != 0:  # root reads any file
        with pytest.raises(ConfigError, match="Permission denied"):
            train(cfg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(600)
def test_an_external_sampler_joins_with_the_configured_token_file(tmp_path):
    """A real trainer whose only group joins by address: the sampler reads the file the trainer
    created from ``service.token_file``, registers and its samples are accepted."""
    from sampler_torch.client import RolloutClient

    port, token = _free_port(), tmp_path / "secrets" / "mixrl_token"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.replace("PORT", str(port)).replace("TOKEN", str(token)))
    run_dir, out, log = tmp_path / "run", tmp_path / "trainer.log", tmp_path / "ext.log"
    with open(out, "w") as f:
        trainer = subprocess.Popen([BIN / "mixrl-train", "--config", cfg, "--run-dir", run_dir],
                                   stdout=f, stderr=subprocess.STDOUT)
    sampler = None
    try:
        weights = run_dir / "weights" / "v00000000" / "bf16"
        deadline = time.monotonic() + 300
        while not (token.is_file() and (weights / "config.json").is_file()):
            assert trainer.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.2)
        assert _mode(token) == 0o600 and not (run_dir / "token").exists()
        model_dir = tmp_path / "ext-model"
        shutil.copytree(weights, model_dir)
        with open(log, "w") as f:
            sampler = subprocess.Popen(
                [BIN / "mixrl-sample", "--trainer", f"127.0.0.1:{port}", "--group", "ext", "--recipe",
                 "bf16", "--model-dir", model_dir, "--token-file", token, "--capacity", "2", "--threads",
                 "1", "--episode-tokens", "32", "--weights-transfer", "shared", "--name", "ext-0",
                 "--weights-cache", tmp_path / "cache", "--device", "cpu"], stdout=f,
                stderr=subprocess.STDOUT, env={k: v for k, v in os.environ.items() if k != "MIXRL_TOKEN"})
        with RolloutClient(f"127.0.0.1:{port}", read_token_file(token), group="ext") as client:
            deadline = time.monotonic() + 300
            while sum(s.accepted for s in client.status().samplers if s.name == "ext-0") < 2:
                assert sampler.poll() is None and trainer.poll() is None and time.monotonic() < deadline, \
                    out.read_text()[-2000:] + log.read_text()[-2000:]
                time.sleep(0.2)
        assert f"(bearer token in {token})" in out.read_text()
        assert "UNAUTHENTICATED" not in log.read_text()
    finally:
        for proc in (trainer, sampler):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)
