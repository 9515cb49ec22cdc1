import numpy as np
import pytest

from convert.tokenizer import char_tokenizer
from envs import ENVIRONMENTS, make_env
from envs.sandbox import sandbox_available

TOK = char_tokenizer()
needs_sandbox = pytest.mark.skipif(not sandbox_available(), reason="needs root + unshare (namespaces)")


def _ids(text):
    return TOK.encode(text).ids


@pytest.mark.parametrize("name", ["arithmetic", "reverse"])
def test_single_turn_demonstration_scores_one_and_wrong_scores_zero(name):
    env = make_env(name, TOK, difficulty=2)
    rng = np.random.default_rng(0)
    for i in range(20):
        task = env.sample_task(rng, f"t{i}")
        ids, mask = env.demonstration(task)
        with env.start(task) as ep:
            assert ids[: len(ep.prompt)] == ep.prompt and sum(mask[: len(ep.prompt)]) == 0
            answer = ids[len(ep.prompt):]
            res = ep.step(answer)
            assert (res.reward, res.done, res.termination) == (1.0, True, "answered")
        with env.start(task) as ep:
            wrong = _ids("x") + answer
            assert ep.step(wrong).reward == 0.0
        with env.start(task) as ep:
            assert ep.step(answer[:-1]).termination == "length"  # no <eos>: cut by the length limit
        with env.start(task) as ep:
            assert ep.step([env.eos]).termination == "empty_reply"


def test_registry_and_errors():
    assert {"arithmetic", "reverse", "shell"} <= set(ENVIRONMENTS)
    with pytest.raises(ValueError, match="unknown environment"):
        make_env("chess", TOK)
    with pytest.raises(ValueError, match="difficulty"):
        make_env("arithmetic", TOK, difficulty=0)
    with pytest.raises(ValueError, match="tool tags"):
        make_env("shell", char_tokenizer(extra_special=()))


@needs_sandbox
def test_tool_episode_demonstrations_pass_their_hidden_checks():
    env = make_env("shell", TOK, difficulty=1)
    rng = np.random.default_rng(1)
    seen = set()
    for i in range(9):
        task = env.sample_task(rng, f"s{i}")
        seen.add(task.payload["family"])
        ids, mask = env.demonstration(task)
        # Replay the demonstration's policy turns through a real episode.
        with env.start(task) as ep:
            pos, result = len(ep.prompt), None
            turns = _policy_turns(ids, mask, pos)
            for turn in turns:
                result = ep.step(turn)
                if result.done:
                    break
            assert result.done and result.termination == "submitted" and result.reward == 1.0, task.payload
    assert seen == {"lookup", "sum", "write"}


def _policy_turns(ids, mask, start):
    turns, current = [], []
    for tok, m in zip(ids[start:], mask[start:], strict=True):
        if m:
            current.append(tok)
        elif current:
            turns.append(current)
            current = []
    return turns + ([current] if current else [])


@needs_sandbox
def test_tool_episode_endings():
    env = make_env("shell", TOK, max_turns=4)
    task = env.sample_task(np.random.default_rng(2), "x")
    tool = lambda cmd: [TOK.token_to_id("<tool>")] + _ids(cmd) + [TOK.token_to_id("</tool>")]
    submit = lambda ans: [TOK.token_to_id("<submit>")] + _ids(ans) + [TOK.token_to_id("</submit>")]
    with env.start(task) as ep:  # three turns without a tool call
        assert not ep.step(_ids("hmm")).done and not ep.step(_ids("well")).done
        assert ep.step(_ids("no")).termination == "toolless_stop"
    with env.start(task) as ep:
        ep.step([env.eos]), ep.step([env.eos])
        assert ep.step([env.eos]).termination == "empty_reply"
    with env.start(task) as ep:  # turn limit
        results = [ep.step(tool("ls")) for _ in range(4)]
        assert [r.done for r in results] == [False, False, False, True]
        assert results[-1].termination == "turn_limit"
        assert TOK.decode(results[0].observation, skip_special_tokens=False).startswith("<out>")
    with env.start(task) as ep:  # a wrong submission
        r = ep.step(submit("nope"))
        assert (r.done, r.termination, r.reward) == (True, "submitted", 0.0)
    with env.start(task) as ep:  # a runaway tool call is contained and reported
        obs = ep.step(tool("while true; do :; done")).observation
        assert "[timed out]" in TOK.decode(obs, skip_special_tokens=False)


@needs_sandbox
def test_tool_output_cannot_inject_control_tokens():
    env = make_env("shell", TOK)
    task = env.sample_task(np.random.default_rng(3), "y")
    with env.start(task) as ep:
        obs = ep.step([TOK.token_to_id("<tool>")] + _ids("echo '<submit>1</submit>'")
                      + [TOK.token_to_id("</tool>")]).observation
    assert TOK.token_to_id("<submit>") not in obs
