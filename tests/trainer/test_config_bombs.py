"""The last input bombs are refused at load (issue 44 item 6), and more of the same kind.

Each is one line naming the problem (and the limit or key to change), raised before the run
directory is touched: through the real ``mixrl-train`` process for the bombs the issue found
(exit 2, one line on stderr, no traceback, the previous run left alone), and through
``load_config`` / ``plan_overrides`` for the rest of the table. The bounded YAML loader is checked
against ``yaml.safe_load`` on every shipped YAML file (same values), so the limits cost nothing to
a real config.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from trainer_jax.config import ConfigError, load_config
from trainer_jax.config.checks import check_host_devices, host_gpus
from trainer_jax.config.yaml_safe import MAX_ALIAS_EXPANSION, read_yaml, short
from trainer_jax.plan_file import PlanError, plan_overrides

BIN = Path(sys.executable).parent
ROOT = Path(__file__).parent.parent.parent


def billion_laughs(levels: int = 9) -> str:
    """The classic alias bomb: each level an anchored list of nine aliases of the one before
    (9^9 = 387 million strings in a few hundred bytes)."""
    lines = [f'l0: &l0 [{", ".join(["lol"] * 9)}]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def _parquet(path: Path, rows: list[dict] | None, schema: pa.Schema | None = None) -> Path:
    table = pa.Table.from_pylist(rows, schema=schema) if rows else pa.table(
        {"q": pa.array([], pa.string()), "a": pa.array([], pa.string())})
    pq.write_table(table, path)
    return path


def _dataset_mix(path: Path) -> list[str]:
    return ["tasks.env=mix", "sft.steps=0",
            f'tasks.mix=[{{env: dataset, options: {{path: "{path}", prompt_key: q, answer_key: a}}}}]']


GROUPS2 = "groups:\n  - {name: bf16, device: cpu}\n  - {name: h100-fp8.x, recipe: fp8, device: cpu}\n"


@pytest.fixture(scope="module")
def bombs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bombs")
    (d / "million.yaml").write_text("groups:\n  - {name: bf16, device: cpu, processes: 1000000}\n")
    (d / "two.yaml").write_text(GROUPS2)
    (d / "plan_million.yaml").write_text("groups:\n  - {name: bf16, processes: 1000000}\n")
    (d / "plan_badname.yaml").write_text("groups:\n  - {name: 7, processes: 1}\n")
    (d / "laughs.yaml").write_text(billion_laughs())
    (d / "brackets.yaml").write_text("run: " + "[" * 20_000 + "]" * 20_000 + "\n")
    (d / "empty.parquet").write_bytes(b"")
    _parquet(d / "good.parquet", [{"q": "1+1?", "a": "2"}, {"q": "2+2?", "a": "4"}])
    _parquet(d / "norows.parquet", None)
    return d


# name -> (args after --config, what the one line must say)
CLI_CASES = {
    "processes": (lambda d: [d / "million.yaml"],
                  "1,000,000 sampler processes to spawn on this host ('bf16': 1000000) is over "
                  "train.max_spawned_samplers 64"),
    "plan_processes": (lambda d: [d / "two.yaml", "--plan", d / "plan_million.yaml"],
                       "is over train.max_spawned_samplers 64"),
    "plan_bad_name": (lambda d: [d / "two.yaml", "--plan", d / "plan_badname.yaml"],
                      "groups.0.name: Input should be a valid string, got 7"),
    "alias_bomb": (lambda d: [d / "laughs.yaml"], f"limit of {MAX_ALIAS_EXPANSION:,} alias expansions"),
    "brackets": (lambda d: [d / "brackets.yaml"], "nested deeper than 100 levels"),
    # a group picked by name as README writes it; a good parquet dataset is read at load (and
    # writes no cache), then the missing GPU refuses the run
    "cuda7": (lambda d: [d / "two.yaml", "groups[h100-fp8.x].device=cuda:7",
                         *_dataset_mix(d / "good.parquet")],
              "groups[h100-fp8.x].device cuda:7: this host has"),
    "empty_parquet": (lambda d: [d / "two.yaml", *_dataset_mix(d / "empty.parquet")],
                      "empty.parquet: an empty file (0 bytes), not a parquet file"),
    "unknown_group": (lambda d: [d / "two.yaml", "groups[h100-fp9].spawn=false"],
                      "no group named 'h100-fp9' (known: bf16, h100-fp8.x)"),
}


@pytest.mark.skipif(os.path.exists("/dev/nvidia7"), reason="this host has a cuda:7")
def test_mixrl_train_refuses_each_bomb_in_one_line_before_the_run_dir(bombs, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    # Every cache a dataset reader could write goes here: nothing may (issue 44: HF datasets
    # wrote ~/.cache/huggingface/datasets for a parquet file).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
           "HF_HOME": str(home / "hf"), "HF_DATASETS_CACHE": str(home / "hf_datasets")}
    procs, started = {}, time.monotonic()
    for name, (args, _) in CLI_CASES.items():
        run_dir = tmp_path / name / "run"
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text("{}")  # an earlier run: must stay where it is
        procs[name] = subprocess.Popen(
            [BIN / "mixrl-train", "--config", *map(str, args(bombs)), "--run-dir", str(run_dir)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, (_, says) in CLI_CASES.items():
        out, err = procs[name].communicate(timeout=240)
        lines = [line for line in err.splitlines() if line.strip()]
        assert procs[name].returncode == 2, (name, out[-2000:], err[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], (name, err[-2000:])
        assert len(lines[0]) < 1000 and "Traceback" not in err + out, (name, err[-2000:])
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["run"], name  # nothing set aside
        assert [p.name for p in (tmp_path / name / "run").iterdir()] == ["summary.json"], name
    assert time.monotonic() - started < 200  # the bombs neither hang nor spawn: all fail at load
    assert [str(p.relative_to(home)) for p in home.rglob("*")] == []


def test_the_alias_bomb_is_refused_in_milliseconds_and_the_limit_is_not_met_by_real_configs(bombs):
    # the document's nodes with aliases expanded, and without: the root mapping, level 0's key,
    # list and 9 strings, each later level's key and list (its 9 items are aliases, not nodes)
    expanded, level = 1, 10
    for _ in range(9):
        expanded += 1 + level
        level = 1 + 9 * level
    written = 1 + 11 + 2 * 8
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"expand to {expanded - written:,} more values than it writes, "
                                          r"over the limit of 100,000 alias expansions"):
        load_config(bombs / "laughs.yaml")
    assert time.perf_counter() - t0 < 2.0
    t0 = time.perf_counter()  # the scanner stops at the 101st bracket, not after looking ahead
    with pytest.raises(ConfigError, match=r"brackets.yaml: nested deeper than 100 levels \(line 1, col"):
        load_config(bombs / "brackets.yaml")
    assert time.perf_counter() - t0 < 1.0
    # one level less than the limit allows passes the loader (9^5 = 59,049 added values)
    assert len(read_yaml_ok(billion_laughs(5))["l4"]) == 9
    # every shipped YAML loads to the same values as yaml.safe_load
    shipped = [p for p in ROOT.glob("**/*.y*ml") if ".venv" not in p.parts and "node_modules" not in p.parts]
    assert len(shipped) >= 10
    for p in shipped:
        assert read_yaml(p, str(p)) == yaml.safe_load(p.read_text()), p


def read_yaml_ok(text: str):
    from trainer_jax.config.yaml_safe import load_yaml

    return load_yaml(text, "test")


def _write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    p = tmp_path / name
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


# (config file content or None, overrides, what the one line must say) -- attacks of our own
ATTACKS = {
    "top_level_list": ("- run\n- train\n", [], "top level must be a mapping of sections, got a list"),
    "nul_byte": ("run: {name: a\x00b}\n", [], "unacceptable character #x0000"),
    "not_utf8": (b"run: {name: \xff\xfe}\n", [], "not UTF-8 text (byte 12: b'\\xff')"),
    "duplicate_keys": ("train: {rows: 8}\nrun: {steps: 2}\ntrain: {rows: 16}\n", [],
                       "duplicate key 'train' (lines 1 and 3)"),
    "python_tag": ("run: !!python/object/apply:os.system ['touch PWNED']\n", [],
                   "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply"),
    "recursive_alias": ("tasks: {chat_template_kwargs: &a {x: *a}}\n", [], "a recursive alias (line 1)"),
    "override_1mb": (None, ["run.name=" + "x" * (1 << 20)], "1,048,585 characters, over the limit of 65,536"),
    "override_bomb": (None, ["tasks.chat_template_kwargs=" + billion_laughs().replace("\n", ", ")
                             .join("{}")], "alias expansions"),
    "override_deep": (None, ["run.name=" + "[" * 5_000], "nested deeper than 100 levels"),
    "negative_rows": (None, ["train.rows=-8"], "train.rows: Input should be greater than 0"),
    "huge_row_len": (None, ["train.row_len=1000000000000000000000000"], "train.row_len 10000000"),
    "inf_capacity": (None, ["groups[bf16].capacity=.inf"], "capacity"),
    "huge_value_in_message": (None, ["tasks.env=" + "y" * 60_000], "tasks: unknown environment 'yyy"),
    "big_list_in_message": (None, ["groups[bf16].capacity=[" + "1," * 2_000 + "1]"],
                            "groups.0.capacity: Input should be a valid integer, got [1, 1, 1"),
    "selector_on_a_section": (None, ["train[x].rows=3"], "the config has no list train to pick [x] from"),
    "selector_unknown_on_defaults": (None, ["groups[fp8].spawn=false"], "no group named 'fp8' (known: bf16)"),
    "malformed_key": (None, ["groups[bf16]spawn=false"], "is not of the form a.b.c or a[NAME].c"),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_an_attack_at_load_is_one_short_line(tmp_path, name):
    content, overrides, says = ATTACKS[name]
    path = _write(tmp_path, "c.yaml", content) if content is not None else None
    cwd = os.getcwd()
    os.chdir(tmp_path)  # where the python/object payload would write
    try:
        with pytest.raises(ConfigError) as e:
            load_config(path, overrides)
    finally:
        os.chdir(cwd)
    msg = str(e.value)
    assert says in msg and "\n" not in msg and len(msg) < 2500, msg[:3000]
    assert not (tmp_path / "PWNED").exists()


def test_files_that_are_not_regular_or_too_big_are_refused_without_reading_them(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:  # 50 MB, sparse: the size alone refuses it
        f.truncate(50 << 20)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opened for reading it would block until a writer came
    (tmp_path / "dir.yaml").mkdir()
    cases = {big: "52,428,800 bytes, over the limit of 1,048,576 bytes", fifo: "not a regular file (a FIFO)",
             tmp_path / "dir.yaml": "not a regular file (a directory)",
             Path("/dev/zero"): "not a regular file (a device)", tmp_path / "none.yaml": "does not exist"}
    signal.alarm(30)  # a FIFO that blocked would hang the test: fail it instead
    try:
        for path, says in cases.items():
            with pytest.raises(ConfigError, match=r"^config file .*" + r".*".join(map(_re, says.split()))):
                load_config(path)
    finally:
        signal.alarm(0)


def _re(s: str) -> str:
    import re

    return re.escape(s)


def test_dataset_paths_that_are_not_files_and_empty_or_corrupt_parquet(bombs, tmp_path):
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1" + os.urandom(300))
    cases = {
        fifo: "rows.jsonl' is not a regular file",
        tmp_path / "dir.jsonl": "dir.jsonl' is not a regular file",
        tmp_path / "zero.jsonl": "zero.jsonl' is not a regular file",
        bombs / "empty.parquet": "an empty file (0 bytes), not a parquet file",
        bombs / "norows.parquet": "norows.parquet has no rows",
        tmp_path / "junk.parquet": "junk.parquet: not a readable parquet file (",
    }
    signal.alarm(30)
    try:
        for path, says in cases.items():
            with pytest.raises(ConfigError) as e:
                load_config(None, _dataset_mix(path))
            assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    finally:
        signal.alarm(0)
    # the good parquet file loads through the same path, rows as they were written
    from envs.dataset import load_rows

    rows = load_rows(str(bombs / "good.parquet"), prompt_key="q", answer_key="a")
    assert len(rows) == 2 and rows[1] == {"q": "2+2?", "a": "4"} and rows["a"] == ["2", "4"]
    cfg = load_config(None, [*_dataset_mix(bombs / "good.parquet"), "groups[bf16].device=cpu"])
    assert cfg.tasks.mix[0].options["path"] == str(bombs / "good.parquet")


def test_spawned_sampler_cap_counts_spawned_groups_only_and_can_be_raised(tmp_path):
    config = _write(tmp_path, "c.yaml", GROUPS2)
    assert sum(g.processes for g in load_config(config, ["groups[bf16].processes=40",
                                                         "groups[h100-fp8.x].processes=24"]).groups) == 64
    with pytest.raises(ConfigError, match=r"65 sampler processes .*\('bf16': 41, 'h100-fp8.x': 24\) is "
                                          r"over train.max_spawned_samplers 64; .*raise train.max_spawned_"):
        load_config(config, ["groups[bf16].processes=41", "groups[h100-fp8.x].processes=24"])
    # external groups (spawn: false) start nothing here; the cap is a key like any other
    external = load_config(config, ["groups[bf16].processes=1000", "groups[bf16].spawn=false"])
    assert external.groups[0].processes == 1000
    assert load_config(config, ["groups[bf16].processes=100", "train.max_spawned_samplers=101"]).train \
        .max_spawned_samplers == 101
    # a plan's counts go through the same check
    plan = _write(tmp_path, "plan.yaml", "groups:\n  - {name: h100-fp8.x, processes: 60}\n")
    with pytest.raises(ConfigError, match=r"68 sampler processes"):
        load_config(config, [*plan_overrides(config, plan), "groups[bf16].processes=8"])


PLANS = {  # a malformed plan -> its one line (plan_overrides, as mixrl-train --plan and mixrl-fleet read it)
    "groups: [{name: [a, b], processes: 1}]": "groups.0.name: Input should be a valid string, got ['a', 'b']",
    "groups: [{name: {x: 1}, processes: 1}]": "groups.0.name: Input should be a valid string, got {'x': 1}",
    "groups: [{name: fp16, processes: 1}]": "group 'fp16' is not a group of",
    "groups: [{name: bf16, processes: -2}]": "groups.0.processes: Input should be greater than or equal to 0",
    "groups: [{name: bf16, processes: true}]": "groups.0.processes: Input should be a valid integer",
    "groups: [{name: bf16, processes: 1.5}]": "groups.0.processes: Input should be a valid integer",
    "groups: [7]": "groups.0: Input should be a valid dictionary",
    "groups: {bf16: 3}": "groups: Input should be a valid list",
    "[bf16, 3]": "needs a mapping with a groups: list",
    "": "got an empty file",
    "groups: []": "its groups: list is empty",
    "groups: [{name: bf16, processes: 1}, {name: bf16, processes: 2}]": "group 'bf16' is listed twice",
    "groups: [{name: bf16, procesess: 2}]": "groups.0.procesess: Extra inputs are not permitted",
    "groups: [{name: bf16, processes: 1, price_per_hour: .nan}]": "groups.0.price_per_hour",
}


def test_a_malformed_plan_is_one_line(tmp_path):
    config = _write(tmp_path, "c.yaml", GROUPS2)
    for text, says in PLANS.items():
        plan = _write(tmp_path, "plan.yaml", text)
        with pytest.raises(PlanError) as e:
            plan_overrides(config, plan)
        assert says in str(e.value) and "\n" not in str(e.value), (text, str(e.value))
    # a config whose own group names are malformed: one line from load_config, not a TypeError here
    odd = _write(tmp_path, "odd.yaml", "groups:\n  - {name: [x], device: cpu}\n  - {name: bf16}\n")
    plan = _write(tmp_path, "plan.yaml", "groups: [{name: bf16, processes: 2}]")
    with pytest.raises(ConfigError, match="groups.0.name: Input should be a valid string"):
        load_config(odd, plan_overrides(odd, plan))


def test_limits_and_prices_files_use_the_same_loader(tmp_path):
    from experiments.plan_solve import load_limits

    bomb = _write(tmp_path, "bomb.yaml", billion_laughs())
    with pytest.raises(PlanError, match=r"^--limits .*bomb.yaml: its aliases expand"):
        load_limits(bomb)
    # keys of mixed types (sorting them was a TypeError)
    with pytest.raises(PlanError, match=r"unknown key 1 \(limits: max_k3"):
        load_limits(_write(tmp_path, "l.yaml", "source: x\n1: 2\nnull: 3\n"))
    with pytest.raises(ConfigError, match=r"^--prices .*bomb.yaml: its aliases expand"):
        load_config(None, prices=bomb)


def test_host_gpus_counts_driver_entries_device_nodes_and_visible_devices(tmp_path):
    proc, dev = tmp_path / "gpus", tmp_path / "dev"
    dev.mkdir()
    assert host_gpus({}, proc, dev) == (0, f"no {proc}, 0 {dev}/nvidiaN device nodes")
    proc.mkdir()
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (proc / bus).mkdir()
    for n in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        (dev / n).touch()
    assert host_gpus({}, proc, dev)[0] == 3
    (dev / "nvidia2").unlink()  # a container that shows the driver's list but two nodes
    assert host_gpus({}, proc, dev)[0] == 2
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "1"}, proc, dev)[0] == 1
    assert host_gpus({"CUDA_VISIBLE_DEVICES": ""}, proc, dev)[0] == 0
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "0,5,1"}, proc, dev)[0] == 1  # CUDA stops at 5
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8a1b,GPU-77"}, proc, dev)[0] == 2
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, proc, dev)[0] == 0
    for n in ("nvidia0", "nvidia1"):
        (dev / n).unlink()
    for bus in proc.iterdir():
        bus.rmdir()
    (dev / "kfd").touch()  # ROCm: GPUs this cannot count, so nothing is refused
    assert host_gpus({}, proc, dev)[0] is None


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="counts this CPU host's zero GPUs")
def test_spawned_devices_are_checked_against_this_host(tmp_path):
    for device in ("cuda:0", "cuda", "cuda:7"):
        cfg = load_config(None, [f"groups[bf16].device={device}"])
        with pytest.raises(ConfigError, match=rf"groups\[bf16\]\.device {device}: this host has 0 CUDA "
                                              rf"device\(s\) .*so there is no {device} here"):
            check_host_devices(cfg, {})
    for overrides in (["groups[bf16].device=cpu"], ["groups[bf16].device=auto"],
                      ["groups[bf16].device=cuda:3", "groups[bf16].spawn=false"],
                      ["groups[bf16].device=cuda:3", "groups[bf16].processes=0"]):
        check_host_devices(load_config(None, overrides), {})  # on this host, or none to spawn


def test_short_never_builds_the_whole_repr():
    shared = ["x"] * 10
    for _ in range(8):  # 10^8 leaves through shared references, as an alias bomb would give
        shared = [shared] * 10
    t0 = time.perf_counter()
    text = short(shared)
    assert time.perf_counter() - t0 < 0.5 and len(text) <= 100
    assert short("z" * 10**7).endswith("zzz'") and len(short("z" * 10**7)) <= 100
