"""Two JAX processes (4 CPU devices each) on one 8-device mesh, through the smoke-check CLI.

``jax.distributed`` from ``MIXRL_*`` environment variables, a sharded MoE train step whose loss
equals the single-device one, a checkpoint saved by both processes and restored onto another
mesh, and weights published by process 0 only (every process taking part in the gathers).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from cpu_jax import cpu_jax_env

from convert.hf_checkpoint import HFCheckpoint
from trainer_jax.config import load_config
from trainer_jax.learner import Learner
from trainer_jax.models import init_model, iter_hf_tensors
from trainer_jax.parallel.check import synthetic_batch
from trainer_jax.policy import model_config

ROOT = Path(__file__).parent.parent.parent
CONFIG = """
model: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
        num_key_value_heads: 2, head_dim: 8, tie_word_embeddings: false, num_experts: 4,
        num_experts_per_tok: 2, moe_intermediate_size: 16, seed: 3}
train: {rows: 8, row_len: 16, max_tokens: 32, support_k: 4}
tasks: {sampling: {head_k: 4}}
optimizer: {learning_rate: 0.001}
mesh: {data: 1, fsdp: 2, expert: 2, tensor: 2}
distributed: {initialization_timeout_s: 120}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_checkpoint_restore_and_publish(tmp_path):
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(CONFIG)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = cpu_jax_env(4, MIXRL_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", MIXRL_NUM_PROCESSES="2",
                          MIXRL_PROCESS_ID=str(rank))
        cmd = [sys.executable, "-m", "trainer_jax.parallel.check", "--config", str(cfg_path), "--steps", "2",
               "--vocab-size", "128", "--checkpoint-dir", str(tmp_path / "ckpt"), "--restore-mesh", "data=8",
               "--publish-dir", str(tmp_path / "weights"), "--out", str(tmp_path / f"report{rank}.json")]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=600)[0])
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"process {rank}:\n{out[-6000:]}"
    assert not (tmp_path / "report1.json").exists()  # only process 0 reports
    report = json.loads((tmp_path / "report0.json").read_text())
    assert (report["processes"], report["devices"]) == (2, 8)
    assert report["mesh"] == "data=1 fsdp=2 expert=2 context=1 tensor=2"
    assert report["checkpoint"]["restored_equal"] and report["checkpoint"]["restored_on"].startswith("data=8")
    # Both processes wrote their shards of the checkpoint.
    written = {p.name for p in (tmp_path / "ckpt").rglob("*")}
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= written, sorted(written)

    # The same steps on one device (this process): same losses, same published weights.
    cfg = load_config(cfg_path)
    qcfg = model_config(cfg, 128)
    inputs, batch = synthetic_batch(128, rows=8, row_len=16, max_tokens=32, head_k=4, support_k=4,
                                    seed=cfg.run.seed)
    ref = Learner(init_model(qcfg, seed=3), cfg.optimizer, cfg.objective)
    losses = [ref.step(inputs, batch).loss for _ in range(2)]
    np.testing.assert_allclose(report["losses"], losses, rtol=1e-5)
    published = HFCheckpoint(tmp_path / "weights" / "v00000002" / "bf16")
    want = dict(iter_hf_tensors(ref.model))
    assert set(published.names()) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(published.get(name).astype(np.float32), value, atol=2e-3, rtol=1e-2)
