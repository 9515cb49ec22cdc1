"""``service.token_file`` is a regular file of at most 4 KiB, read with a bound (issue 44, item 6):
``/dev/zero``, a FIFO, a directory, a 5 KiB file, a missing or empty file are each one line and
exit 2 through ``mixrl-train --config`` and ``mixrl-train serve``, before the run directory is
touched, and the same through the reader (``read_token_file``, ``resolve_token``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mixrl_wire.token_file import MAX_TOKEN_FILE_BYTES
from trainer_jax.config import ConfigError, load_config
from trainer_jax.service.auth import TokenError, read_token_file, resolve_token

BIN = Path(sys.executable).parent


def _bombs(tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, what the error line must say)."""
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    big = tmp / "big"
    big.write_bytes(b"x" * 5 * 1024)
    (tmp / "dir").mkdir()
    link = tmp / "link-to-zero"
    link.symlink_to("/dev/zero")
    loop = tmp / "loop"
    loop.symlink_to(loop)
    return {"zero": (Path("/dev/zero"), "is a character device, not a regular file"),
            "fifo": (fifo, "is a FIFO, not a regular file"),
            "big": (big, "is 5120 bytes, more than the 4096"),
            "dir": (tmp / "dir", "is a directory, not a regular file"),
            "link": (link, "is a character device"),
            "loop": (loop, "Too many levels of symbolic links")}


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_each_bomb_is_one_line_at_load_through_mixrl_train(tmp_path):
    bombs = _bombs(tmp_path)
    procs = {}
    for name in ("zero", "fifo", "big", "dir", "link"):  # started together: 2 CPUs, 5 start-ups
        path = bombs[name][0]
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(f"run: {{name: tok, dir: {tmp_path / f'run-{name}'}}}\n"
                       f"service: {{token_file: '{path}'}}\n")
        procs[name] = subprocess.Popen([BIN / "mixrl-train", "--config", cfg], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    for name, proc in procs.items():
        path, what = bombs[name]
        _, stderr = proc.communicate(timeout=300)  # a loaded CI machine; a hang never ends
        line = _one_error_line(stderr)
        assert proc.returncode == 2 and "service.token_file" in line and what in line, (name, line)
        assert str(path) in line and not (tmp_path / f"run-{name}").exists()


def test_empty_file_is_one_line_before_the_run_directory(tmp_path):
    """Empty is found where the token is read (train(), before the run directory), the config
    load only stats the file."""
    empty, run_dir = tmp_path / "empty", tmp_path / "run"
    empty.write_text("  \n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: {{name: tok, dir: {run_dir}}}\nservice: {{token_file: '{empty}'}}\n")
    proc = subprocess.run([BIN / "mixrl-train", "--config", cfg],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    line = _one_error_line(proc.stderr)
    assert proc.returncode == 2 and f"service.token_file: token file {empty} is empty" in line
    assert not run_dir.exists()


def test_serve_refuses_bombs_and_a_missing_file_in_one_line(tmp_path):
    bombs = _bombs(tmp_path)
    cases = [(bombs["fifo"][0], "is a FIFO"), (bombs["link"][0], "character device"),
             (tmp_path / "missing", "No such file or directory")]
    env = {**os.environ, "MIXRL_TOKEN": "from-env"}  # the file must win over it, not fall back
    procs = [(subprocess.Popen([BIN / "mixrl-train", "serve", "--listen", "127.0.0.1:0", "--token-file",
                                path, "--status-every", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=env), what)
             for path, what in cases]
    for proc, what in procs:
        _, stderr = proc.communicate(timeout=300)  # a loaded CI machine; a hang never ends
        errors = [line for line in stderr.splitlines() if "mixrl-train serve:" in line]
        assert proc.returncode == 2 and len(errors) == 1 and what in errors[0], stderr
        assert "Traceback" not in stderr


@pytest.mark.timeout(120)
def test_the_reader_is_bounded_and_never_blocks(tmp_path):
    for name, (path, what) in _bombs(tmp_path).items():
        for read in (read_token_file, resolve_token):
            with pytest.raises(TokenError, match=what.split(",")[0].replace("(", r"\(")) as e:
                read(path)
            assert "\n" not in str(e.value), name
        with pytest.raises(ConfigError, match=f"service.token_file: token file {path}"):
            load_config(None, [f"service.token_file={path}"])
    # The boundary: exactly 4096 bytes is a token file, one more byte is not.
    edge = tmp_path / "edge"
    edge.write_bytes(b"t" * MAX_TOKEN_FILE_BYTES)
    assert read_token_file(edge) == "t" * MAX_TOKEN_FILE_BYTES
    assert load_config(None, [f"service.token_file={edge}"]).service.token_file == str(edge)
    edge.write_bytes(b"t" * (MAX_TOKEN_FILE_BYTES + 1))
    with pytest.raises(TokenError, match="4097 bytes"):
        read_token_file(edge)
    # Not UTF-8, a path through a regular file, an empty path: one line each.
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00token")
    with pytest.raises(TokenError, match="not UTF-8"):
        read_token_file(binary)
    with pytest.raises(TokenError, match="Not a directory"):
        read_token_file(binary / "token")
    with pytest.raises(ConfigError, match="service.token_file: token file: the path is empty"):
        load_config(None, ["service.token_file=''"])
    # Missing: None for the trainer (it writes a new token there), an error for serve / samplers.
    assert read_token_file(tmp_path / "missing") is None
    assert load_config(None, [f"service.token_file={tmp_path / 'missing'}"])
    with pytest.raises(TokenError, match="No such file"):
        resolve_token(tmp_path / "missing")


@pytest.mark.timeout(120)
def test_a_fifo_with_a_writer_is_still_refused_unread(tmp_path):
    """A FIFO someone keeps writing to (``yes > fifo``) is refused from its stat, not drained."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"yes token > '{fifo}'"], stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(TokenError, match="is a FIFO"):
            read_token_file(fifo)
    finally:
        writer.kill()
        try:  # the writer may still block in open(): an O_NONBLOCK reader lets it finish
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        except OSError:
            pass
        writer.wait(10)


def test_sampler_and_fleet_read_the_token_file_with_the_same_bound(tmp_path):
    """mixrl-sample --token-file and mixrl-fleet's token (fleet.spec.read_token) refuse the same
    bombs in one line, never reading /dev/zero or waiting on a FIFO."""
    from fleet.spec import FleetError, read_token

    bombs = _bombs(tmp_path)
    for name, (path, what) in bombs.items():
        with pytest.raises(FleetError, match="token") as e:
            read_token(str(path), env={})
        assert what in str(e.value), name
    with pytest.raises(FleetError, match="No such file"):
        read_token(str(tmp_path / "missing"), env={"MIXRL_TOKEN": "from-env"})
    proc = subprocess.run([BIN / "mixrl-sample", "--trainer", "127.0.0.1:9", "--group", "g",
                           "--token-file", bombs["fifo"][0], "--connect-timeout-s", "1"],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc.stderr)
    assert line.startswith("mixrl-sample: token file") and "is a FIFO" in line, line
