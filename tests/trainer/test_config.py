import pytest

from trainer_jax.config import ConfigError, load_config


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {name: x, seed: 1}\ngroups:\n  - {name: a, dtype: float32}\n")
    cfg = load_config(path, ["run.seed=7", "model.hidden_size=32", "probe.temperature=0.7"])
    assert (cfg.run.name, cfg.run.seed, cfg.model.hidden_size) == ("x", 7, 32)
    assert cfg.probe.temperature == pytest.approx(0.7)
    assert [g.name for g in cfg.groups] == ["a"]


@pytest.mark.parametrize(
    "text, overrides, match",
    [
        ("run: {sede: 1}\n", [], r"run\.sede"),                      # typo'd key is an error
        ("model: {hidden_size: -4}\n", [], r"model\.hidden_size"),
        ("groups: [{name: a}, {name: a}]\n", [], "unique"),
        ("groups: [{name: a, dtype: int3}]\n", [], r"groups\.0\.dtype"),
        ("- just a list\n", [], "mapping"),
        ("run: {name: [unclosed\n", [], "not valid YAML"),
        ("", ["run.seed"], "key=value"),
        ("run: {name: x}\n", ["run.name.x=1"], "not a section"),
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
