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
    # nor the fleet launcher and Ray (mixrl-fleet, fleet/: above the trainer, never in its process),
    # nor the experiment tools (experiments/: above the trainer)
    forbidden = {"torch", "sampler_torch", "fleet", "ray", "experiments"}
    assert not loaded & forbidden, loaded & forbidden


@pytest.mark.parametrize("module", ["trainer_jax.config", "trainer_jax.service", "envs",
                                    "mixrl_wire.sampling", "mixrl_wire.recipes"])
def test_schema_service_and_envs_load_no_jax_and_no_torch(module):
    loaded = _loaded_after(f"import {module}")
    assert module.split(".")[0] in loaded
    assert not loaded & {"jax", "flax", "optax", "torch", "sampler_torch"}, module


def test_the_experiment_tools_load_no_torch():
    """Every module of ``experiments`` (the sweep, the report, the planner, mixrl-train's dispatcher)
    imports without torch or the samplers; the dispatcher alone loads no JAX, so the trainer's own
    command lines start as they did before it."""
    code = ("import importlib, pkgutil, experiments\n"
            "for m in pkgutil.walk_packages(experiments.__path__, 'experiments.'):\n"
            "    importlib.import_module(m.name)")
    loaded = _loaded_after(code)
    assert {"experiments", "trainer_jax"} <= loaded
    assert not loaded & {"torch", "sampler_torch"}, loaded & {"torch", "sampler_torch"}
    assert not _loaded_after("import experiments.cli") & {"jax", "torch", "trainer_jax"}


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


def test_the_start_up_checks_of_every_shipped_config_keep_torch_out():
    """What mixrl-train runs before training, on every shipped config: load, the batch-shape
    check, the task source with its environments (the sandbox and reward checks included) and the
    kernel choice. Each is imported lazily from the trainer's modules, so the first probe above
    does not see them."""
    # Run configs that load here (the ablation files are sweeps; qwen3_gsm8k needs its data files,
    # tests/test_shipped_configs.py runs it with them).
    configs = sorted(str(p) for p in (Path(__file__).parents[1] / "configs").glob("*.yaml")
                     if not p.name.startswith("ablation") and p.name != "qwen3_gsm8k.yaml")
    assert len(configs) >= 6
    code = "\n".join([
        "from trainer_jax.config import load_config",
        "from trainer_jax.batch_shape import check_config",
        "from trainer_jax.kernels.checked import describe_choice",
        "from trainer_jax.service.tasks import build_task_source",
        "import trainer_jax.config.checks, trainer_jax.service.scoring, envs.rewards.worker",
        "from convert.tokenizer import char_tokenizer",
        f"for path in {configs!r}:",
        "    cfg = load_config(path)",
        "    check_config(cfg)",
        "    if not cfg.model.hf_dir and all(m.env != 'dataset' for m in cfg.tasks.mix_entries()):",
        "        build_task_source(cfg.tasks, tokenizer=char_tokenizer())",
        "describe_choice('attention', 'auto'); describe_choice('linear_logsumexp', 'auto')",
    ])
    loaded = _loaded_after(code)
    assert {"jax", "envs", "trainer_jax"} <= loaded
    assert not loaded & {"torch", "sampler_torch", "transformers"}, loaded & {"torch", "sampler_torch"}


def test_convert_imports_nothing_above_it():
    loaded = _loaded_after("import convert, convert.cli, convert.publish, convert.delta, convert.store")
    assert "convert" in loaded
    assert not loaded & {"trainer_jax", "sampler_torch", "envs", "mixrl_wire", "torch", "jax"}, loaded
