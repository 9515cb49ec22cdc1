"""Bad input is refused when the config loads, in one line naming the key (issue 31, item 5).

A table of bad configs (YAML text plus overrides) -> the key the error must name; the user's
reward modules are real files on the path; a few cases go through the real ``mixrl-train``
process: exit 2, one line on stderr, no traceback, the previous run left where it was and no
model built.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from trainer_jax.config import ConfigError, load_config
from trainer_jax.config.checks import check_model_files

BIN = Path(sys.executable).parent
ROOT = Path(__file__).parent.parent.parent

REWARDS = {  # user reward modules, written into a directory on sys.path
    "myrewards.py": "import math\nfrom os.path import join as joined\n\ndef score(completion, answer):\n"
                    "    return 1.0\n\nTHRESHOLD = 0.5\nscaled = lambda c, a: 0.0\n",
    "brokenrewards.py": "def score(completion, answer)\n    return 1.0\n",
    "pkgrewards/__init__.py": "",
    "pkgrewards/inner.py": "try:\n    from fast import score\nexcept ImportError:\n"
                           "    def score(completion, answer):\n        return 0.0\n",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_input")
    good = json.dumps({"q": "1+1?", "a": "2"})
    (d / "good.jsonl").write_text(good + "\n")
    (d / "bad.jsonl").write_text(good + "\n" + "{not json\n")
    code = d / "code"
    for name, text in REWARDS.items():
        (code / name).parent.mkdir(parents=True, exist_ok=True)
        (code / name).write_text(text)
    return d


@pytest.fixture(autouse=True)
def _rewards_on_path(files, monkeypatch):
    monkeypatch.syspath_prepend(str(files / "code"))


def _mix(env, **options):
    return ["tasks.env=mix", "sft.steps=0", f"tasks.mix=[{json.dumps({'env': env, 'options': options})}]"]


def _dataset(files, **options):
    return _mix("dataset", **{"path": str(files / "good.jsonl"), "prompt_key": "q", "answer_key": "a",
                              **options})


# (YAML text, overrides(files) -> list, the key the one-line error names, a phrase of the problem)
CASES = [
    ("", lambda f: _mix("shell", families=["lokup"], allow_unisolated=True), "options.families.0", "lookup"),
    ("", lambda f: _mix("shell", max_turns="many", allow_unisolated=True), "options.max_turns", "'many'"),
    ("", lambda f: _mix("shell", max_turn=3, allow_unisolated=True), "options.max_turn", "unknown option"),
    ("", lambda f: _mix("shell", max_observation_chars=0, allow_unisolated=True),
     "options.max_observation_chars", "greater than or equal to 1"),
    ("", lambda f: _mix("shell", allow_unisolated="yes"), "options.allow_unisolated", "true or false"),
    ("", lambda f: _mix("shell", families=[], allow_unisolated=True), "options.families", "at least 1"),
    ("", lambda f: _mix("chain", scoring="exakt"), "options.scoring", "'exact', 'steps' or 'prefix'"),
    ("", lambda f: _mix("arithmetic", digits=3), "options.digits", "unknown option"),
    ("", lambda f: _mix("reverse", length=3), "options.length", "unknown option"),
    ("", lambda f: _mix("chat_math", reward_workers=0), "options.reward_workers", "greater than"),
    ("", lambda f: _mix("chat_math", reward_timeout_s=True), "options.reward_timeout_s", "number"),
    ("", lambda f: _mix("chat_math", system_prompt=3), "options.system_prompt", "string"),
    ("", lambda f: _dataset(f, max_row_bytes="big"), "options.max_row_bytes", "integer"),
    ("", lambda f: _dataset(f, skip_bad_rows="yes"), "options.skip_bad_rows", "true or false"),
    ("", lambda f: _dataset(f, prompt_key="question"), "options.prompt_key", "no column 'question'"),
    ("", lambda f: _dataset(f, answer_key="answer"), "options.answer_key", "no column 'answer'"),
    ("", lambda f: _dataset(f, path=str(f / "bad.jsonl")), "bad.jsonl line 2", "invalid JSON"),
    ("", lambda f: _dataset(f, eval_path=str(f / "bad.jsonl")), "bad.jsonl line 2", "invalid JSON"),
    ("", lambda f: _dataset(f, reward="myrewrds:score"), "reward 'myrewrds:score'",
     "No module named 'myrewrds'"),
    ("", lambda f: _dataset(f, reward="myrewards:scroe"), "reward 'myrewards:scroe'", "defines no 'scroe'"),
    ("", lambda f: _dataset(f, reward="myrewards:THRESHOLD"), "reward 'myrewards:THRESHOLD'", "not callable"),
    ("", lambda f: _dataset(f, reward="brokenrewards:score"), "reward 'brokenrewards:score'", "SyntaxError"),
    ("", lambda f: _dataset(f, reward="pkgrewards.iner:score"), "reward 'pkgrewards.iner:score'",
     "No module named 'pkgrewards.iner'"),
    ("", lambda f: _dataset(f, reward="myrewards"), "reward 'myrewards'", "package.module:function"),
    ("train: {advantage: gpro}\n", lambda f: [], "train.advantage", "unknown advantage estimator 'gpro'"),
    ("objective: {aggregation: tokn_mean}\n", lambda f: [], "objective.aggregation", "unknown aggregation"),
    ("objective: {is_mode: miss}\n", lambda f: [], "objective.is_mode", "unknown importance-weight mode"),
    ("objective: {impl: palas}\n", lambda f: [], "objective.impl", "unknown kernel implementation"),
    ("objective: {kernel_options: [[block_vv, 1]]}\n", lambda f: [], "objective.kernel_options",
     "takes no option 'block_vv'"),
    ("service: {router: {policy: fastest}}\n", lambda f: [], "service.router.policy",
     "unknown router policy"),
    ("service: {router: {polcy: uniform}}\n", lambda f: [], "service.router.polcy", "Extra inputs"),
    ("train: {remat: al}\n", lambda f: [], "train.remat", "unknown remat mode"),
    ("train: {weights: {root: 's4://bucket/x'}}\n", lambda f: [], "train.weights.root", "unknown URL scheme"),
    ("train: {weights: {root: 's3://'}}\n", lambda f: [], "train.weights.root", "no bucket"),
    ("train: {weights: {root: 's3:/bucket/x'}}\n", lambda f: [], "train.weights.root", "one slash"),
    ("train: {rows: many}\n", lambda f: [], "train.rows", "'many'"),
    ("train: {sync: maybe}\n", lambda f: [], "train.sync", "true or false"),
    ("mesh: {tensor: 0}\n", lambda f: [], "mesh", ">= 1 or -1"),
    ("tasks: {mix: [{env: shell}]}\n", lambda f: [], "tasks", "only read with env: mix"),
]


@pytest.mark.parametrize("text, overrides, key, problem", CASES,
                         ids=[f"{i}-{c[2]}" for i, c in enumerate(CASES)])
def test_a_bad_config_is_one_line_naming_the_key(files, tmp_path, text, overrides, key, problem):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides(files))
    line = str(e.value)
    assert "\n" not in line and key in line and problem in line, line
    assert len(line) < 600, line


def test_the_good_ones_load(files):
    # The table's neighbours that are right: the checks refuse only what is wrong.
    load_config(None, _mix("shell", families=["lookup", "sum"], max_turns=3, allow_unisolated=True))
    load_config(None, _mix("chain", scoring="prefix"))
    for reward in ("myrewards:score", "myrewards:scaled", "myrewards:joined", "pkgrewards.inner:score",
                   "math", "json:dumps"):  # a def, a lambda, an import; try/except; built-in; stdlib
        cfg = load_config(None, _dataset(files, reward=reward, max_row_bytes=4096, skip_bad_rows=True))
        assert cfg.tasks.mix[0].options["reward"] == reward
    cfg = load_config(None, ["train.advantage=grpo_mean", "service.router.policy=uniform",
                             "train.weights.root=s3://bucket/prefix"])
    assert (cfg.train.advantage, cfg.service.router.policy) == ("grpo_mean", "uniform")


def test_every_options_model_matches_its_environment():
    # The typed models (envs.options) mirror the constructors' keywords and defaults, so a
    # config option is exactly what the environment takes.
    import inspect

    from envs import ENVIRONMENTS
    from envs.options import OPTIONS

    assert set(OPTIONS) == set(ENVIRONMENTS)
    for name, cls in ENVIRONMENTS.items():
        params = {p.name: p.default for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
                  if p.name not in ("tokenizer", "difficulty", "limits")}
        fields = OPTIONS[name].model_fields
        assert set(params) == set(fields), name
        for key, default in params.items():
            if fields[key].is_required():
                continue
            want = list(default) if isinstance(default, tuple) else default
            assert fields[key].default == want, (name, key)


def _tokenizer_dir(d: Path, template: bool) -> Path:
    d.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(d / "tokenizer.json"))
    if template:
        (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    return d


def test_model_dir_and_chat_template_checked_before_anything_starts(tmp_path):
    bare = _tokenizer_dir(tmp_path / "bare", template=False)
    templated = _tokenizer_dir(tmp_path / "templated", template=True)
    for hf_dir, env, match in [(tmp_path / "nowhere", "chat_math", "is not a directory"),
                               (tmp_path, "chat_math", "has no tokenizer.json"),
                               (bare, "chat_math", "no chat template .* env chat_math needs"),
                               (bare, "shell", "no chat template .* env shell needs")]:
        cfg = load_config(None, [f"model.hf_dir={hf_dir}", *_mix(env, **(
            {"allow_unisolated": True} if env == "shell" else {}))])
        with pytest.raises(ConfigError, match=f"model.hf_dir .*{match}"):
            check_model_files(cfg)
    check_model_files(load_config(None, [f"model.hf_dir={templated}", *_mix("chat_math")]))
    # arithmetic needs no template (its own <bos>/<eos> check runs with the batch-shape check)
    check_model_files(load_config(None, [f"model.hf_dir={bare}", "tasks.env=arithmetic"]))


def test_a_mesh_larger_than_the_devices_is_a_config_error():
    from trainer_jax.config import MeshConfig
    from trainer_jax.parallel.mesh import mesh_shape

    for cfg, n, match in [(MeshConfig(data=4), 1, "needs 4 devices, have 1"),
                          (MeshConfig(fsdp=3), 4, "not a multiple of mesh.fsdp 3"),
                          (MeshConfig(dcn_data=2), 3, "mesh.dcn_data")]:
        with pytest.raises(ConfigError, match=match):
            mesh_shape(cfg, n)
    assert mesh_shape(MeshConfig(fsdp=2), 4)[0]["data"] == 2


# Through the real command: (name, args after --config, what the line names). The previous run
# directory must stay put and no model be built, whichever step finds the problem: the config
# (options, a dataset row), the files it names (the tokenizer) or the devices (the mesh).
CLI_CASES = [
    ("families", lambda f: _mix("shell", families=["lokup"], allow_unisolated=True), "options.families.0"),
    ("bad_row", lambda f: _dataset(f, path=str(f / "bad.jsonl")), "bad.jsonl line 2: invalid JSON"),
    ("template", lambda f: [f"model.hf_dir={f / 'bare'}", *_mix("chat_math")], "no chat template"),
    ("mesh", lambda f: ["mesh.data=2"], "mesh: {'data': 2"),
]


def test_mixrl_train_refuses_in_one_line_before_anything_starts(files, tmp_path):
    if not (files / "bare").exists():
        _tokenizer_dir(files / "bare", template=False)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "PYTHONPATH": str(files / "code")}
    procs = {}
    for name, args, _ in CLI_CASES:
        run_dir = tmp_path / name / "run"
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text("{}")  # an earlier run: must stay where it is
        procs[name] = subprocess.Popen(
            [BIN / "mixrl-train", "--config", "configs/local_mixed.yaml", "--run-dir", str(run_dir),
             *args(files)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, _, key in CLI_CASES:
        out, err = procs[name].communicate(timeout=180)
        lines = [line for line in err.splitlines() if line.strip()]
        assert procs[name].returncode == 2, (name, out[-2000:], err[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], (name, err)
        assert "Traceback" not in err + out and "learner on mesh" not in out, (name, out)
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["run"], name  # nothing set aside
        assert [p.name for p in (tmp_path / name / "run").iterdir()] == ["summary.json"], name
