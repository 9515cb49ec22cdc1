"""The TPU-slice and GPU-host configs and launch scripts.

The configs must load, their meshes must fit their machines, and their layouts must fit the
models they name (checked on abstract full-size models: shapes only, no memory). The GPU script
runs the smoke check for real on this CPU; the TPU script is checked by its printed commands.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from shipped_setup import activated

from convert.qwen3_config import Qwen3Config
from trainer_jax.config import load_config
from trainer_jax.models import init_model
from trainer_jax.parallel.mesh import AXES, mesh_shape
from trainer_jax.parallel.rules import ShardingRules, path_str

ROOT = Path(__file__).parent.parent.parent
# The public configs of the models the two files name (shapes only matter here).
QWEN3_30B_A3B = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False)
QWEN3_8B = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)


def _state_gib_per_device(model_cfg: Qwen3Config, run_cfg, devices: int) -> tuple[float, float]:
    """(largest per-device GiB, whole-model GiB) of fp32 params + AdamW moments under the config."""
    ici, dcn = mesh_shape(run_cfg.mesh, devices)
    mesh = AbstractMesh(tuple(ici[a] * dcn[a] for a in AXES), AXES)
    rules = ShardingRules.for_model(model_cfg, run_cfg.mesh.rules)
    state = nnx.state(nnx.eval_shape(lambda: init_model(model_cfg)), nnx.Param)
    per_device = total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        spec = rules.param_spec(path_str(path), leaf.shape, mesh)
        shards = math.prod(math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e))
                           for e in spec if e is not None)
        per_device += leaf.size * 12 / shards  # fp32 value + two fp32 Adam moments
        total += leaf.size * 12
    return per_device / 2**30, total / 2**30


@pytest.mark.parametrize("path, model_cfg, devices, max_gib", [
    ("configs/tpu_slice.yaml", QWEN3_30B_A3B, 32, 12.0),   # v5p-64: 32 chips of 95 GiB
    ("configs/gpu_host.yaml", QWEN3_8B, 8, 12.0),          # 8 x H100 80 GB
])
def test_configs_fit_their_machines(path, model_cfg, devices, max_gib):
    cfg = load_config(ROOT / path)
    ici, dcn = mesh_shape(cfg.mesh, devices)
    batch_shards = math.prod(ici[a] * dcn[a] for a in ("data", "fsdp", "expert"))
    assert cfg.train.rows % batch_shards == 0
    per_device, total = _state_gib_per_device(model_cfg, cfg, devices)
    assert per_device <= max_gib and per_device <= 1.05 * total / devices, (per_device, total)


def test_scripts_parse_and_the_tpu_commands(tmp_path):
    for script in ("launch_tpu_slice.sh", "launch_gpu_host.sh", "slurm_gpu.sbatch"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)
    out = subprocess.run([str(ROOT / "scripts/launch_tpu_slice.sh"), "run", "my-tpu", "us-east5-a",
                          "configs/tpu_slice.yaml", "run.steps=3"], env={**os.environ, "DRY_RUN": "1"},
                         capture_output=True, text=True, check=True).stdout
    assert "tpu-vm ssh --zone us-east5-a --worker=all my-tpu" in out
    assert "trainer_jax.cli\\ --config\\ configs/tpu_slice.yaml\\ run.steps=3" in out  # training
    out = subprocess.run([str(ROOT / "scripts/launch_tpu_slice.sh"), "check", "my-tpu", "us-east5-a",
                          "configs/tpu_slice.yaml", "run.steps=3"], env={**os.environ, "DRY_RUN": "1"},
                         capture_output=True, text=True, check=True).stdout
    assert "trainer_jax.parallel.check\\ --config\\ configs/tpu_slice.yaml\\ run.steps=3" in out
    usage = subprocess.run([str(ROOT / "scripts/launch_tpu_slice.sh")], capture_output=True, text=True)
    assert usage.returncode == 2 and "setup TPU_NAME ZONE" in usage.stdout


def test_gpu_host_script_runs_the_smoke_check_here(tmp_path):
    """The GPU launcher end to end on this CPU: a tiny model on a one-device mesh."""
    out = tmp_path / "report.json"
    env = activated({**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2",
                     "XLA_FLAGS": "--xla_backend_optimization_level=0"})
    proc = subprocess.run(
        [str(ROOT / "scripts/launch_gpu_host.sh"), "--check", "configs/gpu_host.yaml", "model.hf_dir=null",
         "model.dtype=float32", "model.hidden_size=32", "model.intermediate_size=64",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=8",
         "mesh.fsdp=1", "mesh.tensor=1", "mesh.data=-1", "train.rows=2", "train.row_len=16",
         "train.max_tokens=16", "train.support_k=4", "train.micro_rows=1", "--steps", "2",
         "--vocab-size", "64",
         "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["processes"] == 1 and report["mesh"] == "data=1 fsdp=1 expert=1 context=1 tensor=1"
    # The run's memory settings reach the check (configs/gpu_host.yaml: full remat).
    assert (report["remat"], report["micro_rows"], report["attention"]) == ("full", 1, "auto")
    assert len(report["losses"]) == 2 and report["memory"]["state_bytes_per_device"] > 0
    assert report["xla_memory"]["argument_size_bytes"] >= report["memory"]["state_bytes_per_device"]
