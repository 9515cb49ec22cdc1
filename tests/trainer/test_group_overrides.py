"""Groups overridden by name on the command line (issue 45 item 6): ``groups[bf16].capacity=32``.

The key syntax as a table (``parse_key``), then the loaded config against the file's own values:
only the named group changes, for names with dashes, dots and colons, on the default groups too,
with a ``--plan`` merged first (``mixrl-train``'s order), in what the trainer spawns
(``sampler_command``) and what a fleet runs (``load_fleet_config``). An unknown name is one line
listing the known ones. ``mixrl-train`` itself runs these overrides in
``tests/trainer/test_config_bombs.py`` (the ``cuda7`` and ``unknown_group`` cases).
"""

import re
from pathlib import Path

import pytest

from fleet.spec import FleetError, fleet_groups, load_fleet_config
from trainer_jax.config import ConfigError, load_config
from trainer_jax.config.overrides import ByName, parse_key
from trainer_jax.plan_file import plan_overrides
from trainer_jax.samplers import sampler_command

CONFIG = """\
groups:
  - {name: bf16, device: cpu, capacity: 8}
  - {name: h100-fp8, recipe: fp8, device: cpu, capacity: 16}
  - {name: a100.bf16, device: cpu, capacity: 4, spawn: false, processes: 2}
  - {name: "nvfp4:v2", recipe: nvfp4_w4a16, device: cpu, capacity: 2}
tasks:
  env: mix
  mix:
    - {env: arithmetic, name: easy, weight: 1.0}
    - {env: reverse, weight: 2.0}
"""

KEYS = {
    "train.rows": ["train", "rows"],
    "groups[bf16].capacity": ["groups", ByName("bf16"), "capacity"],
    "groups[h100-fp8].spawn": ["groups", ByName("h100-fp8"), "spawn"],
    "groups[a100.bf16].resources.num_gpus": ["groups", ByName("a100.bf16"), "resources", "num_gpus"],
    "groups[nvfp4:v2]": ["groups", ByName("nvfp4:v2")],
    "tasks.mix[easy].weight": ["tasks", "mix", ByName("easy"), "weight"],
}
BAD_KEYS = {
    "groups[bf16]capacity": "is not of the form a.b.c or a[NAME].c",
    "groups.[bf16].capacity": "is not of the form",
    "[bf16].capacity": "is not of the form",
    "groups[].capacity": "is not of the form",
    "groups[b[f]16].capacity": "is not of the form",
    "groups..capacity": "has an empty key part",
    "groups.": "has an empty key part",
    "": "has an empty key part",
}


def test_key_syntax():
    for key, parts in KEYS.items():
        got = parse_key(key, f"{key}=1")
        assert got == parts and [type(p) for p in got] == [type(p) for p in parts], key
    for key, says in BAD_KEYS.items():
        with pytest.raises(ConfigError, match=r"^override '.*'[ :].*" + re.escape(says)):
            parse_key(key, f"{key}=1")


@pytest.fixture
def config(tmp_path) -> Path:
    (tmp_path / "c.yaml").write_text(CONFIG)
    return tmp_path / "c.yaml"


def _groups(cfg) -> dict[str, dict]:
    return {g.name: g.model_dump() for g in cfg.groups}


def test_only_the_named_group_changes(config):
    base = _groups(load_config(config))
    assert [base[n]["capacity"] for n in base] == [8, 16, 4, 2]  # the file's values
    cases = {
        "groups[bf16].capacity=32": ("bf16", "capacity", 32),
        "groups[bf16].spawn=false": ("bf16", "spawn", False),
        "groups[h100-fp8].capacity=64": ("h100-fp8", "capacity", 64),
        "groups[a100.bf16].processes=5": ("a100.bf16", "processes", 5),
        "groups[nvfp4:v2].logit_noise=0.25": ("nvfp4:v2", "logit_noise", 0.25),
        "groups[a100.bf16].resources.num_gpus=1": ("a100.bf16", "resources", {"num_gpus": 1.0}),
    }
    for override, (name, key, value) in cases.items():
        got = _groups(load_config(config, [override]))
        want = {n: dict(g) for n, g in base.items()}
        want[name][key] = value
        assert got == want, override


def test_overrides_compose_and_plain_keys_keep_working(config):
    cfg = load_config(config, ["groups[bf16].capacity=32", "groups[bf16].capacity=12", "train.rows=8",
                               "groups[h100-fp8].spawn=false", "tasks.mix[easy].weight=3"])
    assert [g.capacity for g in cfg.groups] == [12, 16, 4, 2] and cfg.train.rows == 8
    assert [g.spawn for g in cfg.groups] == [True, False, False, True]
    assert [m.weight for m in cfg.tasks.mix] == [3.0, 2.0]
    # the whole list, or one whole entry, as before
    assert [g.name for g in load_config(config, ["groups=[{name: solo, device: cpu}]"]).groups] == ["solo"]
    swapped = load_config(config, ["groups[bf16]={name: bf16, device: cpu, capacity: 3}"]).groups[0]
    assert (swapped.name, swapped.capacity) == ("bf16", 3)
    # on a config that keeps the default groups (one group, bf16)
    default = load_config(None, ["groups[bf16].capacity=32", "groups[bf16].device=cpu"])
    assert [(g.name, g.capacity, g.device) for g in default.groups] == [("bf16", 32, "cpu")]


def test_an_unknown_group_is_one_line_listing_the_known_ones(config):
    for override, says in {
        "groups[fp8].capacity=32": "override 'groups[fp8].capacity=32': no group named 'fp8' (known: bf16, "
                                   "h100-fp8, a100.bf16, nvfp4:v2)",
        "groups[BF16].spawn=false": "no group named 'BF16'",  # names are exact
        "tasks.mix[hard].weight=2": "no entry of tasks.mix named 'hard' (known: easy)",
        "train[bf16].rows=2": "the config has no list train to pick [bf16] from",
        "tasks[x].env=a": "'tasks' is not a list of named entries, so [x] cannot pick one",
        "groups[bf16].capacity.x=1": "'groups[bf16].capacity' is not a section",
        "groups[bf16].capcity=1": "groups.0.capcity: Extra inputs are not permitted",
    }.items():
        with pytest.raises(ConfigError) as e:
            load_config(config, [override])
        assert says in str(e.value) and "\n" not in str(e.value), (override, str(e.value))
    with pytest.raises(ConfigError, match=r"no group named 'fp8' \(known: bf16\)"):
        load_config(None, ["groups[fp8].spawn=false"])


def test_the_override_reaches_what_is_spawned_and_what_a_fleet_runs(config, tmp_path):
    # mixrl-train --plan P key=value: the plan first, the overrides over it
    plan = tmp_path / "plan.yaml"
    plan.write_text("groups:\n  - {name: h100-fp8, processes: 3}\n  - {name: a100.bf16, processes: 0}\n")
    cfg = load_config(config, [*plan_overrides(config, plan), "groups[h100-fp8].capacity=32",
                               "groups[h100-fp8].processes=2"])
    g = next(g for g in cfg.groups if g.name == "h100-fp8")
    cmd = sampler_command(g, 1, address="127.0.0.1:1", model_dir=Path("m"), token_file=Path("t"),
                          cache_dir=Path("c"), episode_tokens=64)
    assert cmd[cmd.index("--capacity") + 1] == "32" and cmd[cmd.index("--group") + 1] == "h100-fp8"
    assert g.processes == 2 and "a100.bf16" not in [x.name for x in cfg.groups]
    # mixrl-fleet --override groups[...]: the fleet's groups are the spawn: false ones
    fleet = load_fleet_config(config, None, ["groups[bf16].spawn=false", "groups[a100.bf16].capacity=9"])
    assert {s.name: s.capacity for s in fleet_groups(fleet)} == {"bf16": 8, "a100.bf16": 9}
    with pytest.raises(FleetError, match="no group named 'gpu0'"):
        load_fleet_config(config, None, ["groups[gpu0].spawn=false"])
