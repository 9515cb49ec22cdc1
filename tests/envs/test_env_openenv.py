"""env: openenv against a real OpenEnv server on loopback (the package's own server framework,
tests/envs/openenv_guess_server.py, in its own process), stepped through the package's own client:
in this process (the trainer's side) and in a sampler's worker process (envs.isolated)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openenv.core.env_server", reason="the openenv extra is not installed (or broken: "
                        "verifiers' mcp 2.0 beside it)", exc_type=ImportError)

from convert.tokenizer import char_tokenizer  # noqa: E402
from envs import make_env  # noqa: E402
from envs.isolated import IsolatedEnvironment, build_env  # noqa: E402
from trainer_jax.config import ConfigError, load_config  # noqa: E402

TOK = char_tokenizer()
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen([sys.executable, str(HERE / "openenv_guess_server.py")], stdout=subprocess.PIPE)
    try:
        port = int(proc.stdout.readline())  # bound before it prints: connections queue until served
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


def _play(env, task) -> tuple[str, float, int, list[str]]:
    """Binary search on the server's hints: (termination, reward, turns, observations)."""
    low, high, seen = 1, 8, []
    with env.start(task) as ep:
        assert env.decode(ep.prompt).startswith("Guess a number from 1 to 8")
        for turn in range(1, 9):
            guess = (low + high) // 2
            result = ep.step(env.encode(f"{guess}\n"))
            if result.done:
                return result.termination, result.reward, turn, seen
            hint = env.decode(result.observation).strip()
            seen.append(hint)
            low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
    raise AssertionError("no end in 8 turns")


def test_episodes_step_an_openenv_server_in_process_and_in_a_worker(server):
    env = make_env("openenv", TOK, url=server, observation_field="text", timeout_s=10)
    task = env.sample_task(np.random.default_rng(0), "t")
    with env.start(task) as a, env.start(task) as b:  # the trainer's prompt is the sampler's
        assert a.prompt == b.prompt
    termination, reward, turns, hints = _play(env, task)
    assert (termination, reward) == ("answered", 1.0) and set(hints) <= {"higher", "lower"}
    assert len(hints) == turns - 1
    isolated = build_env("openenv", TOK, options={"url": server, "observation_field": "text",
                                                  "timeout_s": 10})
    try:
        assert isinstance(isolated, IsolatedEnvironment)
        assert _play(isolated, task) == (termination, reward, turns, hints)
    finally:
        isolated.close()


def test_turn_limit_and_a_refused_action_end_the_episode(server):
    env = make_env("openenv", TOK, url=server, observation_field="text", max_turns=1)
    task = env.sample_task(np.random.default_rng(1), "t")
    with env.start(task) as ep:
        result = ep.step(env.encode("0\n"))  # never the secret (1-8)
        assert (result.done, result.termination, result.reward) == (True, "turn_limit", 0.0)
    wrong = make_env("openenv", TOK, url=server, action_field="guess")  # the action is {message}
    with wrong.start(task) as ep:
        result = ep.step(env.encode("3\n"))
        assert (result.done, result.termination) == (True, "error") and ep.errors == {"server_error": 1}


@pytest.mark.parametrize("options, problem", [
    ("{url: ftp://x}", "url must start with http://"),
    ("{url: 'http://127.0.0.1:1', obs_field: text}", "obs_field"),
    ("{}", "url"),
    ("{url: 'http://127.0.0.1:1', timeout_s: 0}", "timeout_s must be a number of seconds"),
])
def test_openenv_options_are_checked_at_config_load(options, problem):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["sft.steps=0", "tasks.env=mix",
                           f"tasks.mix=[{{env: openenv, options: {options}}}]"])
    assert problem in str(e.value) and "\n" not in str(e.value).strip()
