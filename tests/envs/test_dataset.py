import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from convert.tokenizer import char_tokenizer, load_tokenizer
from envs import make_env
from envs.rewards import RewardResult
from trainer_jax.config import ConfigError, MixEntry, load_config
from trainer_jax.service.tasks import EnvTaskSource

HERE = Path(__file__).parent
ROWS = [{"question": f"{a}+{b}?", "answer": f"#### {a + b}"} for a in range(3) for b in range(3)]


@pytest.fixture(autouse=True)
def _user_module_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _source(path, tokenizer, *, mix_extra=(), **options):
    opts = {"path": str(path), "prompt_key": "question", "answer_key": "answer", "reward": "math"} | options
    return EnvTaskSource([MixEntry(env="dataset", options=opts), *mix_extra], seed=3, tokenizer=tokenizer,
                         chat_template_kwargs={"enable_thinking": False})


def _record(task_id, sample_index, ids):
    """The fields of a validated sample the scorer reads."""
    return SimpleNamespace(task_id=task_id, sample_index=sample_index,
                           policy_token_ids=lambda: np.asarray(ids))


def test_epochs_reshuffle_deterministically_and_the_cursor_resumes_mid_epoch(rows):
    src = _source(rows, char_tokenizer(), shuffle_seed=5)
    try:
        order = [src.task(n)[0].payload["row"] for n in range(3 * len(ROWS))]
        epochs = [order[i: i + len(ROWS)] for i in range(0, len(order), len(ROWS))]
        assert all(sorted(e) == list(range(len(ROWS))) for e in epochs)  # each epoch: every row once
        assert epochs[0] != epochs[1]  # reshuffled
        again = _source(rows, char_tokenizer(), shuffle_seed=5)
        again.cursor = 13  # a resumed run: mid second epoch
        assert [json.loads(again.next_task().payload)["row"] for _ in range(8)] == order[13:21]
        again.close()
    finally:
        src.close()


def test_dataset_in_a_mix_walks_its_rows_in_order(rows):
    src = _source(rows, char_tokenizer(), mix_extra=[MixEntry(env="arithmetic")], shuffle_seed=1)
    try:
        drawn = [t.payload["row"] for t, env in (src.task(n) for n in range(40)) if env.name == "dataset"]
        assert 10 < len(drawn) < 30 and sorted(drawn[: len(ROWS)]) == list(range(len(ROWS)))
        assert [src.task(n)[0] for n in (39, 2, 17)] == [src.task(n)[0] for n in (39, 2, 17)]
    finally:
        src.close()


def test_prompt_rendered_with_the_chat_template_and_scored_by_the_reward(rows, model_dir):
    tok = load_tokenizer(model_dir)
    src = _source(rows, tok, system_prompt="Answer with #### n.")
    try:
        spec = src.spec(0)
        task, env = spec.private
        row = ROWS[task.payload["row"]]
        text = tok.decode(list(spec.prompt_ids), skip_special_tokens=False)
        assert text == ("<|im_start|>system\nAnswer with #### n.<|im_end|>\n"
                        f"<|im_start|>user\n{row['question']}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
        end = tok.token_to_id("<|im_end|>")
        stops = spec.sampling.stop_token_ids
        assert set(env.chat.stop_ids) <= set(stops) and end in stops
        assert len(spec.payload) < 20  # the row index only; the prompt travels as ids
        right = tok.encode(f"it is {row['answer']}", add_special_tokens=False).ids + [end]
        wrong = tok.encode("#### 99", add_special_tokens=False).ids + [end]
        assert src.score(spec, _record(0, 0, right)) == 1.0
        assert src.score(spec, _record(0, 1, wrong)) == 0.0
    finally:
        src.close()


def test_reward_failures_counted_per_group_with_user_metrics(rows):
    src = _source(rows, char_tokenizer(), reward="user_rewards:length_bonus", answer_key=None)
    try:
        spec = src.spec(0)
        eos = char_tokenizer().token_to_id("<eos>")
        for i, ids in enumerate([[eos], [char_tokenizer().token_to_id("7"), eos]]):
            src.score(spec, _record(7, i, ids))
        src.rewards.put((7, 2), RewardResult(0.0, error="timeout", timed_out=True))
        trajs = [SimpleNamespace(task_id=7, sample_index=i, group=g)
                 for i, g in enumerate(["bf16", "fp8", "fp8"])]
        groups = [SimpleNamespace(task=spec, trajectories=trajs)]
        m = src.metrics(groups)
        # answer=None != completion: the user's function scored 0 without error and gave its metrics.
        assert m["reward_errors"] == 0 and m["reward_timeouts"] == 1 and m["group/fp8/reward_timeouts"] == 1
        assert m["group/bf16/reward_timeouts"] == 0 and m["reward/chars"] == 0.5
        assert src.metrics(groups) == {}  # read once
    finally:
        src.close()


def test_bad_dataset_options_fail_at_config_load(rows, tmp_path, model_dir):
    def load(**options):
        entry = json.dumps({"env": "dataset", "options": options})
        return load_config(None, ["tasks.env=mix", f"tasks.mix=[{entry}]"])

    assert load(path=str(rows), prompt_key="question", reward="math").tasks.mix[0].options["reward"] == "math"
    for options, message in [({"reward": "math"}, "options.path is required"),
                             ({"path": str(tmp_path / "x.jsonl")}, "does not exist"),
                             ({"path": str(rows.with_suffix(".csv"))}, "not .jsonl or .parquet"),
                             ({"path": str(rows), "reward": "no colon"}, "package.module:function"),
                             ({"path": str(rows), "rewrad": "math"}, "options.rewrad: unknown option"),
                             ({"path": str(rows), "reward_workers": 0}, "options.reward_workers: Input"),
                             ({"path": str(rows), "reward_timeout_s": "soon"}, "options.reward_timeout_s: ")]:
        with pytest.raises(ConfigError, match=message):
            load(**options)
    with pytest.raises(ValueError, match="arithmetic: needs a tokenizer with <bos> and <eos>"):
        make_env("arithmetic", load_tokenizer(model_dir))
    with pytest.raises(ValueError, match="no column 'prompt'"):
        make_env("dataset", char_tokenizer(), path=str(rows))
    with pytest.raises(ValueError, match="cannot be loaded: ModuleNotFoundError: No module named 'no_such'"):
        make_env("dataset", char_tokenizer(), path=str(rows), prompt_key="question", reward="no_such.mod:fn")


def test_parquet_and_message_lists(tmp_path, model_dir):
    import datasets

    path = tmp_path / "chat.parquet"
    row = {"messages": [{"role": "user", "content": "hello"}], "answer": "x"}
    datasets.Dataset.from_list([row]).to_parquet(path)
    env = make_env("dataset", load_tokenizer(model_dir), path=str(path), prompt_key="messages")
    try:
        with env.start(env.sample_task_at(np.random.default_rng(0), "t0", 0)) as ep:
            text = env.tokenizer.decode(ep.prompt, skip_special_tokens=False)
            assert "<|im_start|>user\nhello<|im_end|>" in text
    finally:
        env.close()


def test_the_qwen3_gsm8k_config_loads_once_its_files_exist(rows, tmp_path):
    text = (Path(__file__).parents[2] / "configs/qwen3_gsm8k.yaml").read_text()
    with pytest.raises(ConfigError, match="data/gsm8k/train.jsonl' does not exist"):
        load_config(_write(tmp_path / "as_shipped.yaml", text))
    local = text.replace("data/gsm8k/train.jsonl", str(rows)).replace("data/gsm8k/test.jsonl", str(rows))
    cfg = load_config(_write(tmp_path / "local.yaml", local))
    assert cfg.tasks.mix[0].options["reward"] == "math"
    assert cfg.tasks.chat_template_kwargs == {"enable_thinking": False}
    assert {g.weight_format for g in cfg.groups} == {"bf16", "fp8_block"}


def _write(path, text):
    path.write_text(text)
    return path


def test_dataset_tasks_keep_the_trainer_torch_free(rows):
    """The trainer process builds and scores dataset tasks: neither datasets nor the reward pool
    may pull torch into it (tests/test_seam.py checks the default config's trainer)."""
    import subprocess
    import sys

    code = (f"import sys; from convert.tokenizer import char_tokenizer; from envs import make_env; "
            f"env = make_env('dataset', char_tokenizer(), path={str(rows)!r}, prompt_key='question', "
            f"answer_key='answer', reward='math'); import numpy as np; "
            f"t = env.sample_task_at(np.random.default_rng(0), 't0', 3); "
            f"print(env.score(t, env.encode('#### 4')).error, 'torch' in sys.modules); env.close()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parents[2])
    assert out.stdout.split() == ["None", "False"], out.stderr[-2000:]


def test_evaluation_draws_from_the_held_out_file(rows, tmp_path):
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"question": "held out?", "answer": "#### 1"}) + "\n")
    opts = {"path": str(rows), "eval_path": str(held_out), "prompt_key": "question", "answer_key": "answer"}
    train = EnvTaskSource([MixEntry(env="dataset", options=opts)], tokenizer=char_tokenizer())
    evaluation = EnvTaskSource([MixEntry(env="dataset", options=opts)], tokenizer=char_tokenizer(),
                               evaluation=True, prefix="eval")
    try:
        decode = lambda src, n: src.tokenizer.decode(list(src.spec(n).prompt_ids))  # noqa: E731
        assert {decode(evaluation, n) for n in range(3)} == {"held out?\n"}
        assert "held out?\n" not in {decode(train, n) for n in range(len(ROWS))}
    finally:
        train.close()
        evaluation.close()


def test_a_warm_start_over_dataset_tasks_fails_at_load(rows):
    entry = json.dumps({"env": "dataset", "options": {"path": str(rows), "prompt_key": "question"}})
    with pytest.raises(ConfigError, match="dataset tasks have no demonstrations"):
        load_config(None, ["tasks.env=mix", f"tasks.mix=[{entry}]", "sft.steps=5"])
