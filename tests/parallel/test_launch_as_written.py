"""The launch scripts run exactly as the configs' headers, the README and their usage text write
them: with and without overrides, ``check`` too, and with Python found as the usage text says
($PYTHON, else the active venv, else python3 on PATH; on a TPU host the checkout's .venv that
``setup`` installs comes before python3).

The program each host runs is a recorder standing in for Python: it writes the arguments it got,
one bracketed per argument, so an empty argument is ``[]`` and the whole command line is compared
exactly. The TPU slice is the stand-in ``gcloud`` of the shipped-config test (every worker a local
process with its own HOME and checkout). Real runs through both launchers: tests/test_shipped_configs.py.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from shipped_setup import make_tpu_workers

ROOT = Path(__file__).parent.parent.parent
GPU, TPU = ROOT / "scripts/launch_gpu_host.sh", ROOT / "scripts/launch_tpu_slice.sh"
# "/bin/sh" and `printf` only: one of these is named python3 and put first on PATH.
OVERRIDES = ["run.steps=3", "--run-dir", "runs/a b"]  # a flag and a value with a space travel too
RECORDER = '#!/bin/sh\nprintf "%s:" "{label}"; for a in "$@"; do printf "[%s]" "$a"; done; echo\n'


def _recorder(path: Path, label: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(RECORDER.format(label=label))
    path.chmod(0o755)
    return path


def _documented(source: Path, script: str) -> list[list[str]]:
    """The launch command lines a file writes (``scripts/launch_...`` to the end of the line,
    comments and trailing '#...' notes dropped), split as a shell would."""
    out = []
    for line in source.read_text().splitlines():
        m = re.search(rf"(scripts/{script}\s.*?)\s*(#.*)?$", line.lstrip("# "))
        if m and line.lstrip("# ").startswith("scripts/"):
            out.append(m.group(1).split())
    return out


def _bare_env(**extra: str) -> dict[str, str]:
    """This environment without a venv or $PYTHON (a shell where nothing is activated)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON")}
    return {**env, **extra}


def test_the_documented_forms_are_the_tested_ones():
    """The lines these tests run are the ones the configs' headers and the README carry."""
    gpu = _documented(ROOT / "configs/gpu_host.yaml", "launch_gpu_host.sh")
    tpu = _documented(ROOT / "configs/tpu_slice.yaml", "launch_tpu_slice.sh")
    assert gpu == [["scripts/launch_gpu_host.sh", "configs/gpu_host.yaml"],
                   ["scripts/launch_gpu_host.sh", "--check", "configs/gpu_host.yaml"]], gpu
    assert tpu == [["scripts/launch_tpu_slice.sh", a, "$TPU_NAME", "$ZONE", "configs/tpu_slice.yaml"]
                   for a in ("run", "check")], tpu
    readme = (ROOT / "README.md").read_text()
    assert "scripts/launch_gpu_host.sh [--check] CONFIG" in readme
    assert "scripts/launch_tpu_slice.sh setup|run|check|stop TPU ZONE [CONFIG]" in readme


@pytest.mark.parametrize("check", [False, True], ids=["train", "check"])
@pytest.mark.parametrize("overrides", [[], OVERRIDES], ids=["bare", "overrides"])
def test_gpu_launcher_passes_exactly_the_arguments(tmp_path, check, overrides):
    venv = _recorder(tmp_path / "venv/bin/python", "venv")
    cmd = [str(GPU), *(["--check"] if check else []), "configs/gpu_host.yaml", *overrides]
    out = subprocess.run(cmd, env=_bare_env(VIRTUAL_ENV=str(tmp_path / "venv")), capture_output=True,
                         text=True, timeout=60)
    module = "trainer_jax.parallel.check" if check else "trainer_jax.cli"
    expected = "venv:" + "".join(f"[{a}]" for a in ["-m", module, "--config", "configs/gpu_host.yaml",
                                                    *overrides])
    assert (out.returncode, out.stdout.strip()) == (0, expected), out.stdout + out.stderr
    assert venv.exists()


def test_gpu_launcher_finds_python_as_its_usage_says(tmp_path):
    """$PYTHON first, then the active venv, then python3 on PATH; none: one line from the shell
    naming python3 (exit 127), not the old .venv/bin/python default."""
    _recorder(tmp_path / "venv/bin/python", "venv")
    _recorder(tmp_path / "path/python3", "path")
    explicit = _recorder(tmp_path / "my python/py", "explicit")
    path = f"{tmp_path / 'path'}:{os.environ['PATH']}"

    def run(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(GPU), "configs/gpu_host.yaml"], env=_bare_env(**env), capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)  # cwd: the script moves to the checkout

    args = "[-m][trainer_jax.cli][--config][configs/gpu_host.yaml]"
    assert run(PYTHON=str(explicit), VIRTUAL_ENV=str(tmp_path / "venv"), PATH=path).stdout.strip() \
        == "explicit:" + args
    assert run(VIRTUAL_ENV=str(tmp_path / "venv"), PATH=path).stdout.strip() == "venv:" + args
    assert run(PATH=path).stdout.strip() == "path:" + args
    none = run(PATH=_no_python3_path(tmp_path))
    assert none.returncode == 127 and "python3" in none.stderr, none.stderr
    usage = subprocess.run([str(GPU)], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2
    assert "Python: $PYTHON, else the active venv ($VIRTUAL_ENV/bin/python), else python3 on PATH" \
        in " ".join(usage.stdout.split())


def _no_python3_path(tmp_path: Path) -> str:
    """A PATH with the tools the script needs (bash, awk) and no python3."""
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for tool in ("bash", "awk", "dirname"):
        found = next(Path(d) / tool for d in os.environ["PATH"].split(":") if (Path(d) / tool).is_file())
        (tools / tool).symlink_to(found)
    return str(tools)


def _slice(tmp_path: Path, workers: int = 2) -> tuple[dict[str, str], list[Path]]:
    """The stand-in slice without the checkout's .venv (each test puts its own Python there)."""
    bin_dir = make_tpu_workers(tmp_path, workers)
    checkouts = []
    for i in range(workers):
        checkout = tmp_path / f"worker-{i}" / "mixrl"
        (checkout / ".venv").unlink()
        checkouts.append(checkout)
    env = _bare_env(PATH=f"{bin_dir}:{os.environ['PATH']}", GCLOUD_STANDIN_ROOT=str(tmp_path),
                    GCLOUD_STANDIN_WORKERS=str(workers), GCLOUD_STANDIN_COORDINATOR="127.0.0.1:1")
    return env, checkouts


def _worker_lines(checkouts: list[Path]) -> list[str]:
    return [(c / "logs" / f"tpu-worker-{i}.log").read_text().strip() for i, c in enumerate(checkouts)]


@pytest.mark.parametrize("line", [0, 1], ids=["run", "check"])
@pytest.mark.parametrize("overrides", [[], OVERRIDES], ids=["bare", "overrides"])
def test_tpu_launcher_as_the_config_writes_it(tmp_path, line, overrides):
    """``run`` / ``check`` as configs/tpu_slice.yaml's header writes them, with no override (the
    program got '' as an override, exit 2 on every host) and with some; Python is the checkout's
    .venv on each host, as ``setup`` installs it."""
    env, checkouts = _slice(tmp_path)
    for c in checkouts:
        _recorder(c / ".venv/bin/python", "setup-venv")
    cmd = _documented(ROOT / "configs/tpu_slice.yaml", "launch_tpu_slice.sh")[line]
    cmd = [str(TPU), *[{"$TPU_NAME": "my-tpu", "$ZONE": "us-east5-a"}.get(a, a) for a in cmd[1:]],
           *overrides]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    module = "trainer_jax.parallel.check" if line else "trainer_jax.cli"
    expected = "setup-venv:" + "".join(
        f"[{a}]" for a in ["-m", module, "--config", "configs/tpu_slice.yaml", *overrides])
    assert _worker_lines(checkouts) == [expected, expected], out.stdout
    assert out.stdout.splitlines() == [expected, expected]  # each host's line on this terminal too


def test_tpu_launcher_finds_python_on_each_host(tmp_path):
    """$PYTHON (a path on the hosts) first, then the host's active venv, then the checkout's .venv,
    then python3 on the host's PATH."""
    env, checkouts = _slice(tmp_path)
    explicit = _recorder(tmp_path / "opt py/python", "explicit")
    _recorder(tmp_path / "active/bin/python", "active")
    for i in range(len(checkouts)):
        _recorder(tmp_path / f"worker-{i}/bin/python3", "python3")
    cmd = [str(TPU), "run", "s", "z", "configs/tpu_slice.yaml"]
    args = "[-m][trainer_jax.cli][--config][configs/tpu_slice.yaml]"

    def hosts(**extra: str) -> list[str]:
        out = subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        lines = _worker_lines(checkouts)
        assert all(line.endswith(":" + args) for line in lines), lines
        return [line.split(":", 1)[0] for line in lines]

    assert hosts() == ["python3", "python3"]  # nothing installed by setup: the host's python3
    for c in checkouts:
        _recorder(c / ".venv/bin/python", "setup-venv")
    assert hosts() == ["setup-venv", "setup-venv"]
    assert hosts(VIRTUAL_ENV=str(tmp_path / "active")) == ["active", "active"]
    assert hosts(VIRTUAL_ENV=str(tmp_path / "active"), PYTHON=str(explicit)) == ["explicit", "explicit"]
    usage = subprocess.run([str(TPU)], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "Python on each host: $PYTHON" in usage.stdout


def test_gpu_launcher_on_several_hosts_as_its_usage_writes_it(tmp_path):
    """``NNODES=2 NODE_RANK=0|1 COORDINATOR=host0:12345 scripts/launch_gpu_host.sh CONFIG
    mesh.dcn_data=2``: each host's program gets its place in jax.distributed's variables; a
    missing rank or coordinator is one line from the script."""
    py = tmp_path / "venv/bin/python"
    py.parent.mkdir(parents=True)
    py.write_text('#!/bin/sh\necho "$MIXRL_NUM_PROCESSES $MIXRL_PROCESS_ID $MIXRL_COORDINATOR_ADDRESS $*"\n')
    py.chmod(0o755)
    env = _bare_env(VIRTUAL_ENV=str(tmp_path / "venv"), NNODES="2", COORDINATOR="host0:12345")
    for rank in ("0", "1"):
        out = subprocess.run([str(GPU), "configs/gpu_host.yaml", "mesh.dcn_data=2"],
                             env={**env, "NODE_RANK": rank}, capture_output=True, text=True, timeout=60)
        want = f"2 {rank} host0:12345 -m trainer_jax.cli --config configs/gpu_host.yaml mesh.dcn_data=2"
        assert out.stdout.strip() == want, out.stdout + out.stderr
    for missing, says in (("NODE_RANK", "NODE_RANK is required with NNODES > 1"),
                          ("COORDINATOR", "COORDINATOR=host:port is required with NNODES > 1")):
        out = subprocess.run([str(GPU), "configs/gpu_host.yaml"],
                             env={k: v for k, v in {**env, "NODE_RANK": "0"}.items() if k != missing},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and out.stdout == "" and says in out.stderr, out.stderr


def test_tpu_setup_and_stop_as_their_usage_writes_them(tmp_path):
    """``setup`` and ``stop`` (DRY_RUN=1: the gcloud commands, as the usage text says)."""
    env = {**_bare_env(), "DRY_RUN": "1"}
    setup = subprocess.run([str(TPU), "setup", "my-tpu", "us-east5-a"], env=env, capture_output=True,
                           text=True, timeout=60)
    lines = [line.strip() for line in setup.stdout.splitlines()]
    assert setup.returncode == 0 and len(lines) == 2, setup.stdout + setup.stderr
    assert lines[0].startswith("gcloud compute tpus tpu-vm scp --zone us-east5-a --worker=all ")
    assert lines[0].endswith(" my-tpu:/tmp/mixrl.tar.gz")
    assert "python3\\ -m\\ venv\\ .venv" in lines[1]
    assert ".venv/bin/pip\\ install\\ -q\\ -e\\ \\'.\\[tpu\\]\\'" in lines[1]
    archive = Path(lines[0].split()[-2])
    assert archive.name == "mixrl.tar.gz" and not archive.parent.exists()  # the local copy is removed
    stop = subprocess.run([str(TPU), "stop", "my-tpu", "us-east5-a"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert stop.returncode == 0 and stop.stdout.startswith(
        "gcloud compute tpus tpu-vm ssh --zone us-east5-a --worker=all my-tpu --command pkill"), stop.stdout
