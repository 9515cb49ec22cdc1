"""The seam between trainer and samplers holds in the imports, not just in the docs."""

import subprocess
import sys
from pathlib import Path

import pytest


def _loaded_after(code: str) -> set[str]:
    probe = (f"import sys\n{code}\n"
             "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_trainer_process_imports_neither_torch_nor_the_sampler():
    loaded = _loaded_after("import trainer_jax.cli, trainer_jax.train, trainer_jax.service.server")
    assert "jax" in loaded  # the probe really imported the trainer
    assert not loaded & {"torch", "sampler_torch"}, loaded & {"torch", "sampler_torch"}


@pytest.mark.parametrize("module", ["trainer_jax.config", "trainer_jax.service", "envs",
                                    "mixrl_wire.sampling", "mixrl_wire.recipes"])
def test_schema_service_and_envs_load_no_jax_and_no_torch(module):
    loaded = _loaded_after(f"import {module}")
    assert module.split(".")[0] in loaded
    assert not loaded & {"jax", "flax", "optax", "torch", "sampler_torch"}, module


def test_a_config_with_a_typo_in_a_recipe_fails_at_load():
    from trainer_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"groups\.0\.recipe: .*unknown recipe 'nvfp4_w4a44'"):
        load_config(Path(__file__).parents[1] / "configs" / "local_mixed.yaml",
                    ["groups=[{name: a, recipe: nvfp4_w4a44}]"])


def test_the_metrics_sink_keeps_torch_out(tmp_path):
    """tensorboardX imports torch when it is installed; the trainer's sink hides it (a run of
    mixrl-train was checked the same way with an import hook: no torch over a whole run)."""
    code = f"from trainer_jax.diagnostics import MetricsSink\nMetricsSink({str(tmp_path)!r}).close()"
    loaded = _loaded_after(code)
    assert "tensorboardX" in loaded and "torch" not in loaded


def test_the_recipe_table_and_quantized_linears_need_no_protobuf():
    """``mixrl_wire``'s generated modules load on first use: the recipe table, the samplers'
    quantized linears and the GPU check's torch part run where protobuf / grpcio are older than
    the generated code wants (or absent), while the wire itself still loads on demand."""
    loaded = _loaded_after("import mixrl_wire.recipes, sampler_torch.recipes.linear")
    assert "sampler_torch" in loaded and not loaded & {"grpc", "google"}, loaded & {"grpc", "google"}
    assert "google" in _loaded_after("from mixrl_wire import TRAJECTORY_ARRAY_FIELDS")
