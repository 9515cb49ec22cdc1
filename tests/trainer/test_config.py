import pytest

from trainer_jax.config import ConfigError, load_config


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {name: x, seed: 1}\ngroups:\n  - {name: a, recipe: fp8}\n")
    cfg = load_config(path, ["run.seed=7", "model.hidden_size=32", "tasks.sampling.temperature=0.7",
                             "objective.is_mode=tis", "tasks.env=mix",
                             "tasks.mix=[{env: arithmetic, difficulty: 2}]"])
    assert (cfg.run.name, cfg.run.seed, cfg.model.hidden_size) == ("x", 7, 32)
    assert cfg.tasks.sampling.temperature == pytest.approx(0.7)
    assert cfg.objective.is_mode == "tis" and cfg.tasks.mix[0].difficulty == 2
    assert cfg.groups[0].recipe == "fp8"
    assert [g.name for g in cfg.groups] == ["a"]


@pytest.mark.parametrize(
    "text, overrides, match",
    [
        ("run: {sede: 1}\n", [], r"run\.sede"),                      # typo'd key is an error
        ("model: {hidden_size: -4}\n", [], r"model\.hidden_size"),
        ("groups: [{name: a}, {name: a}]\n", [], "unique"),
        ("groups: [{name: a, attention: flash9}]\n", [], r"groups\.0\.attention"),
        ("model: {attention: flash}\n", [], r"model\.attention: .*unknown attention implementation"),
        ("objective: {c_max: -1}\n", [], r"objective\.c_max"),
        ("- just a list\n", [], "mapping"),
        ("run: {name: [unclosed\n", [], "not valid YAML"),
        ("", ["run.seed"], "key=value"),
        ("run: {name: x}\n", ["run.name.x=1"], "not a section"),
        ("groups: [{name: a, recipe: nvfp4_w4a44}]\n", [], r"groups\.0\.recipe: .*unknown recipe"),
        ("groups: [{name: a, kv_cache_dtype: fp9}]\n", [], r"groups\.0\.kv_cache_dtype"),
        ("tasks: {env: mix}\n", [], "non-empty mix"),
        ("tasks: {env: arithmetc}\n", [], "unknown environment 'arithmetc'"),
        ("tasks: {sampling: {temperature: 0}}\n", [], "temperature must be > 0"),
        ("tasks: {sampling: {top_q: 0.5}}\n", [], r"tasks\.sampling\.top_q"),
        ("train: {eval_group: gpu}\n", [], "eval_group 'gpu' is not a group"),
    ],
)
def test_bad_configs_name_the_problem(tmp_path, text, overrides, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path, overrides)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/c.yaml")
