"""Batch shapes that fit (issue 30, item 5): the worst-case arithmetic of ``trainer_jax.batch_shape``
against the real packer, the error / ``allow_drop`` warning, the shipped configs before and after
their fix, a dataset's longest prompt measured through the chat template, and a character-level
task refused with a model's tokenizer before anything starts (item 4a)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from trainer_jax.batch_shape import Demand, check, check_config, check_tasks, fit
from trainer_jax.config import ConfigError, load_config

ROOT = Path(__file__).parent.parent.parent
_spec = importlib.util.spec_from_file_location("chat_dir", ROOT / "tests" / "envs" / "chat_dir.py")
chat_dir = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chat_dir)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A model directory: a byte-level BPE trained here with a ChatML-style template (no weights)."""
    return chat_dir.make_model_dir(tmp_path_factory.mktemp("model"))


def test_fit_counts_what_the_packer_is_guaranteed_to_place():
    one = [Demand("a", 1.0, tokens=10, policy=6)]
    assert fit(4, one, rows=2, row_len=20, max_tokens=24).fits  # 2 a row x 2 rows, 24 // 6 = 4
    rows_short = fit(4, one, rows=1, row_len=20, max_tokens=24)
    assert (rows_short.capacity, rows_short.drop_share) == (2, 0.5)
    tokens_short = fit(4, one, rows=2, row_len=20, max_tokens=12)
    assert (tokens_short.tokens_capacity, tokens_short.drop_share) == (2, 0.5)
    # An entry longer than a row drops its whole share; the rest is budgeted on its own.
    mix = [Demand("long", 1.0, tokens=30, policy=20), Demand("short", 3.0, tokens=10, policy=6)]
    both = fit(8, mix, rows=4, row_len=20, max_tokens=64)
    assert both.too_long == ("long",) and both.drop_share == 0.25 and both.capacity == 8


def _sample(rng, prompt: int, reply: int):
    from trainer_jax.batching import Sample

    ids = rng.integers(1, 50, prompt + reply).astype(np.int32)
    mask = np.r_[np.zeros(prompt), np.ones(reply)].astype(np.uint8)
    return Sample(token_ids=ids, loss_mask=mask, logprobs=np.zeros(reply, np.float32),
                  head_ids=np.zeros((reply, 1), np.int32), head_logprobs=np.zeros((reply, 1), np.float32),
                  support_indptr=np.zeros(reply + 1, np.int32), support_ids=np.zeros(0, np.int32),
                  support_logprobs=np.zeros(0, np.float32), versions=np.zeros(reply, np.int32))


@pytest.mark.parametrize("rows,row_len,max_tokens", [(3, 40, 200), (4, 33, 40)])
def test_the_guarantee_holds_for_the_real_packer(rows, row_len, max_tokens):
    """Random lengths up to the worst case: ``batching.pack`` always takes at least ``capacity``."""
    from trainer_jax.batching import pack

    rng = np.random.default_rng(rows * row_len)
    prompt, new = 5, 9
    guaranteed = fit(64, [Demand("a", 1.0, prompt + new, new)], rows=rows, row_len=row_len,
                     max_tokens=max_tokens).capacity
    for _ in range(5):
        samples = [_sample(rng, int(rng.integers(1, prompt + 1)), int(rng.integers(1, new + 1)))
                   for _ in range(64)]
        _, _, taken = pack(samples, np.zeros(64, np.float32), rows=rows, row_len=row_len,
                           max_tokens=max_tokens, head_k=1, support_k=1, temperature=1.0, trainer_version=0)
        assert len(taken) >= guaranteed
    worst = [_sample(rng, prompt, new) for _ in range(64)]  # and the bound is tight at the worst case
    _, _, taken = pack(worst, np.zeros(64, np.float32), rows=rows, row_len=row_len, max_tokens=max_tokens,
                       head_k=1, support_k=1, temperature=1.0, trainer_version=0)
    assert len(taken) == guaranteed


def test_a_shape_that_drops_is_an_error_or_with_allow_drop_a_warning():
    base = ["tasks.env=arithmetic", "tasks.group_size=4", "tasks.sampling.max_new_tokens=12",
            "train.prompts_per_step=8", "train.rows=4", "train.row_len=64", "train.max_tokens=1024"]
    cfg = load_config(None, base)
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    message = str(e.value)
    assert "\n" not in message
    for part in ("train.prompts_per_step 8 x tasks.group_size 4 = 32 samples of up to 17 tokens",
                 "train.rows 4 x train.row_len 64 place at least 12 of them (3 a row)",
                 "up to 62% of a step's samples dropped", "Fits: train.rows 11", "train.allow_drop: true"):
        assert part in message
    warning = check(load_config(None, [*base, "train.allow_drop=true"]), [5])
    assert warning.startswith("train.allow_drop: a step makes") and "up to 62%" in warning
    assert check(load_config(None, [*base, "train.rows=11"]), [5]) is None
    # Multi-turn entries are budgeted by train.episode_tokens: a longer sample never fits a row.
    shell = load_config(None, ["tasks.env=shell", "train.episode_tokens=128", "train.row_len=128"])
    with pytest.raises(ConfigError, match=r"longer than train.row_len 128, so every shell sample .* "
                                          r"lower train.episode_tokens"):
        check_config(shell)


# Each shipped launch config with the numbers it had before this fix (issue 30).
OLD = {
    "gpu_host.yaml": ["tasks.env=arithmetic", "tasks.mix=[]", "train.rows=8", "train.row_len=2048",
                      "train.max_tokens=8192"],
    "tpu_slice.yaml": ["tasks.env=arithmetic", "tasks.mix=[]", "train.rows=32", "train.row_len=2048",
                       "train.max_tokens=32768"],
    "qwen3_gsm8k.yaml": ["train.rows=32", "train.row_len=1024", "train.max_tokens=32768",
                         "train.micro_rows=null"],
}


@pytest.fixture
def gsm8k_files(tmp_path, monkeypatch):
    """qwen3_gsm8k.yaml's data files (relative paths) in a scratch working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    rows = [{"question": f"Tom has {i} apples and buys {i} more. How many now?", "answer": f"#### {2 * i}"}
            for i in range(8)]
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / "data" / "gsm8k" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


@pytest.mark.parametrize("name", sorted(OLD))
def test_shipped_configs_refused_with_their_old_shapes(name, gsm8k_files):
    cfg = load_config(ROOT / "configs" / name, OLD[name])
    with pytest.raises(ConfigError, match="dropped when replies run to their limit"):
        check_config(cfg)


def test_every_shipped_config_passes_at_load(gsm8k_files):
    names = sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("ablation"))
    assert {"gpu_host.yaml", "tpu_slice.yaml", "qwen3_gsm8k.yaml", "local_mixed.yaml"} <= set(names)
    for name in names:
        check_config(load_config(ROOT / "configs" / name))


def test_launch_configs_fit_with_a_model_tokenizer(model_dir, gsm8k_files):
    """With a chat template, every prompt measured: gpu_host / tpu_slice's chat_math and the
    GSM8K-format dataset fit their shapes with room (chat_dir's 400-token BPE is far less
    compact than Qwen's, so its prompts are longer than a real model's)."""
    from convert.tokenizer import load_tokenizer
    from trainer_jax.batch_shape import longest_prompts

    tokenizer = load_tokenizer(model_dir)
    for name in ("gpu_host.yaml", "tpu_slice.yaml", "qwen3_gsm8k.yaml"):
        cfg = load_config(ROOT / "configs" / name)
        assert check_tasks(cfg, tokenizer) is None
        (prompt,) = longest_prompts(cfg, tokenizer)
        assert 40 < prompt < 300, (name, prompt)


def test_dataset_longest_prompt_is_measured_through_the_chat_template(tmp_path, model_dir):
    from convert.tokenizer import load_tokenizer
    from envs import make_env
    from envs.base import Task
    from envs.dataset import longest_prompt

    tokenizer = load_tokenizer(model_dir)
    path = tmp_path / "rows.jsonl"
    questions = ["hi", "what is 2 + 3? " * 12, "hello world"]
    path.write_text("".join(json.dumps({"q": q, "a": "1"}) + "\n" for q in questions))
    options = {"path": str(path), "prompt_key": "q", "answer_key": "a", "system_prompt": "Think."}
    env = make_env("dataset", tokenizer, **options)
    try:
        lengths = [len(env.start(Task(str(i), "dataset", {"row": i})).prompt) for i in range(3)]
        assert longest_prompt(tokenizer, options) == max(lengths) == lengths[1] > 60
        assert env.longest_prompt() == max(lengths)
    finally:
        env.close()
    # The same row count of new tokens fits at load (prompt unknown) and not once it is measured.
    base = [f"model.hf_dir={model_dir}", "tasks.env=mix", "tasks.group_size=2",
            f"tasks.mix=[{{env: dataset, options: {json.dumps(options)}}}]",
            "tasks.sampling.max_new_tokens=16", "train.prompts_per_step=2", "train.rows=4",
            "train.row_len=64", "train.max_tokens=64"]
    cfg = load_config(None, base)
    check_config(cfg)
    with pytest.raises(ConfigError, match=rf"samples of up to {max(lengths) + 16} tokens \(dataset"):
        check_tasks(cfg, tokenizer)


def test_char_level_task_with_a_model_tokenizer_is_refused_before_anything_starts(tmp_path, model_dir):
    from trainer_jax.train import train

    cfg = load_config(None, [f"model.hf_dir={model_dir}", "tasks.env=arithmetic",
                             f"run.dir={tmp_path / 'run'}"])
    # train() refuses it right after the tokenizer loads: before jax.distributed, the checkpoint
    # (this directory has none: building the model would fail differently) and the run directory.
    with pytest.raises(ConfigError, match=r"^tasks \(arithmetic\): arithmetic: needs a tokenizer with "
                                          r"<bos> and <eos> .* use env: chat_math"):
        train(cfg)
    assert not (tmp_path / "run").exists()
