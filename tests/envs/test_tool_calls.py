import json

import numpy as np
import pytest

from convert.tokenizer import load_tokenizer
from envs import make_env
from envs.sandbox import sandbox_available
from envs.tool_calls import ChatToolEpisode, parse_tool_calls, turn_stats


def _call(name, **args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_parse_tool_calls_separates_well_formed_from_malformed():
    calls, bad = parse_tool_calls("let me look " + _call("shell", command="cat a.txt"))
    assert calls == [{"name": "shell", "arguments": {"command": "cat a.txt"}}] and bad == 0
    text = ("<tool_call>{not json}</tool_call>" + _call("rm_rf", path="/") +
            '<tool_call>{"name": "shell", "arguments": "ls"}</tool_call><tool_call>{"name": "shell"')
    assert parse_tool_calls(text) == ([], 4)  # bad JSON, unknown tool, arguments not an object, unclosed
    assert parse_tool_calls("the answer is 4") == ([], 0)


@pytest.mark.skipif(not sandbox_available(), reason="needs root + unshare (namespaces)")
def test_shell_env_speaks_the_models_tool_protocol(model_dir):
    tok = load_tokenizer(model_dir)
    env = make_env("shell", tok, families=("sum",))
    env.chat_template_kwargs = {"enable_thinking": False}
    task = env.sample_task(np.random.default_rng(0), "s0")
    stop = tok.token_to_id("<|im_end|>")
    with env.start(task) as ep:
        assert isinstance(ep, ChatToolEpisode)
        prompt = tok.decode(ep.prompt, skip_special_tokens=False)
        assert '"name": "shell"' in prompt
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        r = ep.step(env.chat.encode(_call("shell", command="cat a.txt b.txt")) + [stop])
        assert not r.done
        a, b = (task.payload["files"][f].strip() for f in ("a.txt", "b.txt"))
        # The result comes back as the template's tool turn, then the next generation prompt.
        assert tok.decode(r.observation, skip_special_tokens=False) == (
            f"\n<|im_start|>user\n<tool_response>\n{a}\n{b}\n\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert ep.step(env.chat.encode("no call here") + [stop]).observation  # nudged, not ended
        r = ep.step(env.chat.encode(_call("submit", answer=str(int(a) + int(b)))) + [stop])
        assert (r.done, r.reward, r.termination) == (True, 1.0, "submitted")
    with env.start(task) as ep:
        for _ in range(2):
            assert not ep.step([stop]).done
        assert ep.step([stop]).termination == "empty_reply"  # three replies without a call
    ids, mask = env.demonstration(task)
    stats = turn_stats(env.chat, np.asarray(ids), np.asarray(mask))
    assert stats == {"turns": 2, "malformed_calls": 0, "empty_replies": 0, "toolless_turns": 0}


def test_turn_stats_counts_the_collapse_signatures(model_dir):
    tok = load_tokenizer(model_dir)
    env = make_env("shell", tok, allow_unisolated=True)
    stop = tok.token_to_id("<|im_end|>")
    turns = [_call("shell", command="ls"), "<tool_call>{oops</tool_call>", "", "I give up"]
    ids, mask = [1, 2, 3], [0, 0, 0]
    for text in turns:
        reply = env.chat.encode(text) + [stop]
        ids += reply + [4, 5]
        mask += [1] * len(reply) + [0, 0]
    stats = turn_stats(env.chat, np.asarray(ids), np.asarray(mask))
    assert stats == {"turns": 4, "malformed_calls": 1, "empty_replies": 1, "toolless_turns": 1}


def test_task_source_reports_tool_turn_shares_per_group(model_dir):
    from types import SimpleNamespace

    from trainer_jax.config import MixEntry
    from trainer_jax.service.tasks import EnvTaskSource

    tok = load_tokenizer(model_dir)
    src = EnvTaskSource([MixEntry(env="shell", options={"allow_unisolated": True})], tokenizer=tok)
    spec = src.spec(0)
    chat, stop = spec.private[1].chat, tok.token_to_id("<|im_end|>")

    def episode(*turns):
        ids, mask = list(spec.prompt_ids), [0] * len(spec.prompt_ids)
        for text in turns:
            reply = chat.encode(text) + [stop]
            ids, mask = ids + reply + [4], mask + [1] * len(reply) + [0]
        return np.asarray(ids), np.asarray(mask)

    trajs = []
    for i, (group, turns) in enumerate([("bf16", [_call("shell", command="ls"), "<tool_call>{</tool_call>"]),
                                        ("fp8", ["", "", ""])]):
        ids, mask = episode(*turns)
        trajs.append(SimpleNamespace(task_id=0, sample_index=i, group=group, token_ids=ids, loss_mask=mask))
    m = src.metrics([SimpleNamespace(task=spec, trajectories=trajs)])
    assert m["group/bf16/tool_malformed"] == 0.5 and m["group/bf16/tool_empty"] == 0.0
    assert m["group/fp8/tool_empty"] == 1.0 and m["tool/empty"] == 3 / 5 and m["tool/toolless"] == 0.0
