"""The "bring your own environment" runs, as written: the README's import-path one
(docs/examples/guess_env.py, the page docs/environments.md prints) in the dev venv, and the OpenEnv
one of docs/environments.md in `.venv-openenv` (`make venv-openenv`: OpenEnv 0.10's mcp < 2 cannot
share the dev venv with verifiers' mcp 2.0). Both configs load on every run. The commands run from
a directory that links the repository's docs/ and tests/ (and .venv-openenv) so the relative paths
resolve and runs/ lands there. The OpenEnv commands run under `make test-openenv` (this file in
`.venv-openenv`, built and current); elsewhere that test skips."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer_jax.config import load_config

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
OPENENV_VENV = REPO / ".venv-openenv"


# config file -> (the document that writes its run, the section heading it is under)
DOCS = {"my_run.yaml": ("README.md", "### Bring your own environment"),
        "openenv_run.yaml": ("docs/environments.md", "### OpenEnv servers")}


def _doc_block(config: str) -> tuple[str, list[str]]:
    """The yaml block that starts ``# <config>`` and the bash block after it (comments dropped), from
    the section of the document that writes it (``DOCS``)."""
    doc, heading = DOCS[config]
    section = (REPO / doc).read_text().split(heading, 1)[1]
    rest = section[section.index(f"```yaml\n# {config}\n"):]
    yaml = re.search(r"```yaml\n(.*?)```", rest, re.S).group(1)
    bash = re.search(r"```bash\n(.*?)```", rest, re.S).group(1)
    return yaml, [line.split("  #")[0].strip() for line in bash.splitlines() if line.strip()]


def _episodes(run_dir: Path) -> list[dict]:
    return [json.loads(line) for f in sorted((run_dir / "episodes").glob("*.jsonl"))
            for line in f.read_text().splitlines()]


def _train(command: str, cwd: Path, env: dict) -> None:
    t0 = time.monotonic()
    out = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(f"{command}: {time.monotonic() - t0:.0f} s")


def test_the_import_path_config_loads_and_the_example_file_is_the_documented_one(tmp_path, monkeypatch):
    doc = (REPO / "docs" / "environments.md").read_text()
    code = re.search(r"```python\n(# guess_env\.py\n.*?)```", doc, re.S).group(1)
    assert (REPO / "docs" / "examples" / "guess_env.py").read_text() == code
    yaml, commands = _doc_block("my_run.yaml")
    assert commands == ["PYTHONPATH=docs/examples mixrl-train --config my_run.yaml"]
    (tmp_path / "my_run.yaml").write_text(yaml)
    monkeypatch.syspath_prepend(str(REPO / "docs" / "examples"))
    cfg = load_config(str(tmp_path / "my_run.yaml"), [])
    assert [(m.name, m.env) for m in cfg.tasks.mix_entries()] == [("guess", "guess_env:Guess")]
    assert (cfg.run.steps, cfg.model.num_hidden_layers) == (2, 1)  # small enough for `make test`


def test_the_openenv_config_loads_and_its_commands_use_the_openenv_venv(tmp_path):
    yaml, commands = _doc_block("openenv_run.yaml")
    assert commands == ["make venv-openenv",
                        ".venv-openenv/bin/python tests/envs/openenv_guess_server.py 8765 &",
                        ".venv-openenv/bin/mixrl-train --config openenv_run.yaml"]
    (tmp_path / "openenv_run.yaml").write_text(yaml)
    cfg = load_config(str(tmp_path / "openenv_run.yaml"), [])
    ((name, env, options),) = [(m.name, m.env, m.options) for m in cfg.tasks.mix_entries()]
    assert (name, env, options["url"]) == ("server_guess", "openenv", "http://127.0.0.1:8765")
    # What `make venv-openenv` would run (make -n: nothing is installed), into the documented path.
    plan = subprocess.run(["make", "-n", "-B", "venv-openenv", "TORCH_INDEX="], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert "python3 -m venv .venv-openenv" in plan
    assert ".venv-openenv/bin/python -m pip install -q --no-compile -e '.[openenv,test]'" in plan
    assert ".venv-openenv/bin/python -m compileall -qq -j 0 .venv-openenv/lib" in plan
    assert ".venv-openenv/" in (REPO / ".gitignore").read_text().splitlines()


@pytest.mark.timeout(600)
def test_the_import_path_block_trains_as_written(tmp_path):
    yaml, (train,) = _doc_block("my_run.yaml")
    (tmp_path / "docs").symlink_to(REPO / "docs")
    (tmp_path / "my_run.yaml").write_text(yaml)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}  # the dev venv, active
    env.pop("PYTHONPATH", None)
    _train(train, tmp_path, env)
    episodes = _episodes(tmp_path / "runs" / "byo")
    assert len(episodes) == 2 * 4 * 2  # steps x prompts_per_step x group_size, all logged
    assert {e["env"] for e in episodes} == {"Guess"}
    assert {e["turns"][0]["text"] for e in episodes} == {"Guess my number (1-8). Reply with a number.\n"}
    observations = {t["text"].strip() for e in episodes for t in e["turns"] if t["role"] == "observation"}
    assert observations and observations <= {"higher", "lower"}, observations


@pytest.mark.timeout(900)
def test_the_openenv_block_trains_as_written(tmp_path):
    if Path(sys.prefix).resolve() != OPENENV_VENV.resolve():  # keeps `make test`'s time as it is
        pytest.skip("runs in .venv-openenv: `make test-openenv` builds it and runs this test there")
    make, server, train = _doc_block("openenv_run.yaml")[1]
    if subprocess.run(["make", "-q", "venv-openenv"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip(".venv-openenv is older than pyproject.toml: `make venv-openenv` (or make test-openenv)")
    # as written, from the repository root; up to date, so make does nothing (never rebuilds the
    # venv under a running test)
    out = subprocess.run(["bash", "-c", make], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Nothing to be done" in out.stdout, out.stdout + out.stderr
    for name in ("docs", "tests", ".venv-openenv"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "openenv_run.yaml").write_text(_doc_block("openenv_run.yaml")[0])
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.Popen(["bash", "-c", "exec " + server.rstrip("&").strip()], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE)
    try:
        port = proc.stdout.readline().strip()  # bound before it prints; nothing if 8765 is taken
        assert port == b"8765", f"the documented OpenEnv server did not start on port 8765: {port!r}"
        _train(train, tmp_path, env)
    finally:
        proc.terminate()
        proc.wait(30)
    episodes = _episodes(tmp_path / "runs" / "openenv")
    assert len(episodes) == 2 * 4 * 2
    assert {e["turns"][0]["text"].split("(")[0] for e in episodes} == {"Guess a number from 1 to 8 "}
    assert {e["termination"] for e in episodes} <= {"answered", "turn_limit", "error", "empty_reply"}
