"""Outside environments run in worker processes (envs.isolated): an exception, a hang or a garbage
output ends only its episode, counted under its reason, and the next episode runs; through a real
mixrl-sample process against a real rollout service, the counts reach the trainer's metrics and
the sampler carries on."""

import json
import sys
import time
from pathlib import Path

import pytest

from convert.tokenizer import char_tokenizer
from envs import Task
from envs.isolated import EnvCallFailed, IsolatedEnvironment, build_env
from trainer_jax.config import ConfigError, load_config

TOK = char_tokenizer()
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(HERE) not in sys.path:  # hostile_envs imports as a user's package would (and in workers)
    sys.path.insert(0, str(HERE))


@pytest.fixture(scope="module")
def hostile():
    env = build_env("hostile_envs:Hostile", TOK, options={"timeout_s": 1.5})
    assert isinstance(env, IsolatedEnvironment) and env.name == "Hostile"
    yield env
    env.close()


def _episode(env, mode: str):
    """(termination, reward, errors) of one episode of ``mode``, one turn of "7\\n"."""
    with env.start(Task("t", "hostile", {"mode": mode})) as ep:
        assert ep.prompt == env.encode("go:")
        result = ep.step(env.encode("7\n"))
        return result.termination if result.done else None, result.reward, ep.errors


@pytest.mark.parametrize("mode, reason", [
    ("raise", "exception"), ("hang", "timeout"), ("exit", "crashed"), ("nan", "bad_reward"),
    ("bad_obs", "bad_observation"), ("text_obs", "bad_observation"), ("done_str", "bad_done"),
    ("not_result", "bad_output"),
])
def test_a_failing_step_ends_its_episode_counted_and_the_next_one_runs(hostile, mode, reason):
    t0 = time.monotonic()
    assert _episode(hostile, mode) == ("error", 0.0, {reason: 1})
    assert time.monotonic() - t0 < 10  # the hang ended at its 1.5 s timeout
    # The environment's own counts ride along; a killed worker was replaced.
    assert _episode(hostile, "ok") == ("answered", 1.0, {"own_reason": 1})


@pytest.mark.parametrize("mode, reason", [
    ("start_raise", "exception"), ("start_hang", "timeout"), ("start_garbage", "bad_output")])
def test_a_failing_start_raises_its_reason_for_the_sampler(hostile, mode, reason):
    with pytest.raises(EnvCallFailed) as e:
        hostile.start(Task("t", "hostile", {"mode": mode}))
    assert e.value.reason == reason
    assert _episode(hostile, "ok")[0] == "answered"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The sampler's real engine over a tiny random model of the character tokenizer."""
    sys.path.insert(0, str(REPO / "tests" / "service"))
    from tiny import tiny_char_model

    from sampler_torch.engine import Engine

    return Engine(tiny_char_model(tmp_path_factory.mktemp("m") / "m"), "bf16")


def test_the_sampler_runs_a_failed_start_as_one_counted_turn(hostile, engine):
    """A start that raises is one turn from the task's prompt, ended ``error;exception``; the
    other task of the round is unaffected."""
    from mixrl_wire import pb
    from sampler_torch.loop import SamplerLoop

    loop = SamplerLoop(None, engine, tokenizer=TOK)
    loop._envs["hostile"] = hostile
    sampling = pb.SamplingParams(temperature=1.0, top_p=1.0, head_k=0, max_new_tokens=3,
                                 stop_token_ids=hostile.encode("\n"))
    items = [(pb.Task(task_id=i, env="hostile", payload=json.dumps({"mode": mode}).encode(),
                      prompt_ids=hostile.encode("go:"), group_size=1, sampling=sampling), 0)
             for i, mode in enumerate(("start_raise", "ok"))]
    failed, ok = loop._generate(items)
    assert failed["finish_reason"] == "error;exception" and failed["reward"] == 0.0
    assert len(failed["token_ids"]) >= 1
    assert ok["finish_reason"] == "answered;own_reason" and ok["reward"] == 1.0


def test_a_sampler_carries_on_through_failing_outside_environments(engine):
    """A real rollout service on loopback and a real SamplerLoop leasing a mix of an environment
    that works and three that fail in step (raise, hang past timeout_s, NaN reward): every
    group arrives, each failure counted in the trainer's env/<name>/errors/<reason> metrics,
    and the sampler is still leasing when the test ends."""
    import threading

    from sampler_torch.client import RolloutClient
    from sampler_torch.loop import LoopConfig, SamplerLoop
    from trainer_jax.service import RolloutService
    from trainer_jax.service.tasks import env_error_metrics

    mix = ", ".join(f'{{env: "hostile_envs:Hostile", name: {name}, options: {{mode: {mode}, timeout_s: 1}}}}'
                    for name, mode in (("works", "ok"), ("raises", "raise"), ("hangs", "hang"),
                                       ("nan", "nan")))
    cfg = load_config(None, ["sft.steps=0", "tasks.env=mix", f"tasks.mix=[{mix}]", "tasks.group_size=2",
                             "tasks.sampling.max_new_tokens=3",
                             "service.listen=127.0.0.1:0", "service.lease_ttl_s=120"])
    svc = RolloutService.from_config(cfg, token="tok").start()
    client = RolloutClient(svc.address, "tok", group="g", capacity=4, name="s")
    loop = SamplerLoop(client, engine, LoopConfig(capacity=4), tokenizer=TOK)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        taken, deadline = [], time.monotonic() + 90
        while {g.task.env for g in taken} != {"works", "raises", "hangs", "nan"}:
            assert time.monotonic() < deadline and thread.is_alive(), [g.task.env for g in taken]
            taken += svc.buffer.take_groups(1, timeout=1.0)
        metrics = env_error_metrics(taken)
        per_env = {g.task.env: {t.finish_reason for t in g.trajectories} for g in taken}
        assert per_env["works"] == {"answered;own_reason"}
        assert per_env["raises"] == {"error;exception"} and per_env["hangs"] == {"error;timeout"}
        assert per_env["nan"] == {"error;bad_reward"}
        for name, reason in (("raises", "exception"), ("hangs", "timeout"), ("nan", "bad_reward")):
            n = sum(len(g.trajectories) for g in taken if g.task.env == name)
            assert metrics[f"env/{name}/errors/{reason}"] == n
        # Still generating after all of that: more samples accepted. (A group already in the
        # buffer proves nothing: it can predate this point, as it did once on CI.)
        accepted, deadline = loop.stats.accepted, time.monotonic() + 60
        while loop.stats.accepted <= accepted:
            assert time.monotonic() < deadline and thread.is_alive(), loop.stats
            svc.buffer.take_groups(1, timeout=0.5)
        workers = [w for env in loop._envs.values() for w in env._all]
        assert workers  # the environments' worker processes, stopped with the loop below
    finally:
        loop.stop()
        client.request_stop()
        thread.join(30)
        client.close()
        svc.stop(grace=0)
    assert not thread.is_alive() and all(w.proc.poll() is not None for w in workers)


@pytest.mark.parametrize("value", ["0", "-1", "abc", "true", "5000"])
def test_timeout_s_is_checked_at_config_load(value):
    with pytest.raises(ConfigError, match=r"timeout_s must be a number of seconds") as e:
        load_config(None, ["sft.steps=0", "tasks.env=mix",
                           f'tasks.mix=[{{env: "hostile_envs:Hostile", options: {{timeout_s: {value}}}}}]'])
    assert "\n" not in str(e.value).strip()


def test_timeout_s_is_accepted_by_every_outside_environment_and_never_reaches_it():
    cfg = load_config(None, ["sft.steps=0", "tasks.env=mix", 'tasks.mix=[{env: "hostile_envs:Hostile", '
                             'name: h, options: {mode: nan, timeout_s: 2}}]'])
    (entry,) = cfg.tasks.mix_entries()
    from envs import make_env

    env = make_env(entry.env, TOK, **entry.options)  # the trainer's side: built in-process
    assert env.mode == "nan" and not hasattr(env, "timeout_s")
