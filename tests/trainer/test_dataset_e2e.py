"""The whole loop on a real vocabulary: ``mixrl-train`` with an HF directory (a tiny random Qwen3
with Qwen's 151,936-row vocabulary and its real byte-level BPE), a JSONL dataset, a held-out
file for evaluation, a reward function in a module of this test, and two spawned sampler groups."""

import base64
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("dashscope", reason="the real Qwen vocabulary ships with dashscope (the dev extra)")
BIN = Path(sys.executable).parent
_spec = importlib.util.spec_from_file_location("qwen_vocab", Path(__file__).with_name("qwen_vocab.py"))
qwen_vocab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qwen_vocab)

REWARD_MODULE = '''
import sys


def score(*, completion, answer, prompt, task):
    assert "<|im_start|>user" in prompt and task["question"] in prompt
    assert "torch" not in sys.modules  # the reward workers stay torch-free
    return {"reward": float(answer.split("####")[-1].strip() in completion), "reply_chars": len(completion)}
'''

CONFIG = """
run: {{name: e2e, seed: 0, steps: 2}}
model: {{hf_dir: {hf_dir}}}
sft: {{steps: 0}}
tasks:
  env: mix
  group_size: 2
  chat_template_kwargs: {{enable_thinking: false}}
  sampling: {{temperature: 1.0, head_k: 4, max_new_tokens: 6}}
  mix:
    - env: dataset
      options: {{path: {train}, eval_path: {held_out}, prompt_key: question, answer_key: answer,
                 system_prompt: "Answer after ####.", reward: "e2e_reward:score", reward_timeout_s: 30,
                 reward_workers: 1, shuffle_seed: 7}}
service: {{listen: "127.0.0.1:0", buffer: {{max_trajectories: 16}}}}  # 4 steps' worth (tests/loop_configs.py)
groups:
  - {{name: bf16, recipe: bf16, capacity: 2}}
  - {{name: fp8, recipe: fp8, capacity: 2}}
train: {{prompts_per_step: 2, publish_every: 1, checkpoint_every: 2, eval_every: 0, eval_tasks: 2,
        eval_k: 2, rows: 4, row_len: 64, max_tokens: 256, support_k: 4, take_timeout_s: 300}}
"""


def _rows(path: Path, start: int, n: int) -> None:
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i}\n#### {2 * i}"}
            for i in range(start, start + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_converted_vocabulary_tokenizes_like_tiktoken(tmp_path_factory):
    tiktoken = pytest.importorskip("tiktoken")  # installed with dashscope
    import dashscope

    from convert.tokenizer import load_tokenizer

    d = _tokenizer_dir(tmp_path_factory)
    ranks = {base64.b64decode(t): int(r) for t, r in (ln.split() for ln in (
        Path(dashscope.__file__).parent / "resources" / "qwen.tiktoken").read_text().splitlines() if ln)}
    enc = tiktoken.Encoding("qwen", pat_str=qwen_vocab.QWEN2_PATTERN, mergeable_ranks=ranks,
                            special_tokens={})
    tok = load_tokenizer(d)
    for text in ["Natalia sold clips to 48 of her friends in April, and then she sold half as many.",
                 "def f(x):\n    return x ** 2  # über naïve 日本語\n\n\n", "#### 1,234.50"]:
        assert tok.encode(text, add_special_tokens=False).ids == enc.encode(text)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import jax.numpy as jnp

    from convert.qwen3_config import Qwen3Config
    from trainer_jax.models import init_model, save_hf

    cfg = Qwen3Config(vocab_size=qwen_vocab.MODEL_VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("qwen3") / "hf"
    save_hf(init_model(cfg, dtype=jnp.float32, seed=0), cfg, out, dtype="bfloat16",
            tokenizer_dir=_tokenizer_dir(tmp_path_factory))
    return out


_TOKENIZER: list[Path] = []


def _tokenizer_dir(factory) -> Path:
    if not _TOKENIZER:  # converting 151,643 ranks takes seconds: once per module
        _TOKENIZER.append(qwen_vocab.qwen_tokenizer_dir(factory.mktemp("qwen_tokenizer")))
    return _TOKENIZER[0]


@pytest.mark.timeout(900)
def test_mixrl_train_on_a_dataset_with_a_user_reward(tmp_path, hf_dir):
    _rows(tmp_path / "train.jsonl", 0, 16)
    _rows(tmp_path / "held_out.jsonl", 100, 4)
    (tmp_path / "e2e_reward.py").write_text(REWARD_MODULE)
    cfg = tmp_path / "e2e.yaml"
    cfg.write_text(CONFIG.format(hf_dir=hf_dir, train=tmp_path / "train.jsonl",
                                 held_out=tmp_path / "held_out.jsonl"))
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([BIN / "mixrl-train", "--config", cfg, "--run-dir", run_dir], capture_output=True,
                         text=True, timeout=840, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0 and "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # The user's function scored every trained sample (its extra key became a metric), none failed.
        assert r["samples_trained"] > 0 and r["reward/reply_chars"] > 0
        assert r["reward_errors"] == 0 and r["reward_timeouts"] == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "eval/pass@1" in summary["eval_end"]  # the held-out file, scored by the same reward
    # Full exports carry the source's tokenizer files byte for byte (chat template included);
    # delta versions between them carry only changed tensors.
    for fmt in ("bf16", "fp8_block"):
        full = [d for d in sorted((run_dir / "weights").glob(f"v*/{fmt}")) if (d / "config.json").exists()]
        assert full, fmt
        for d in full:
            for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
                assert (d / name).read_bytes() == (hf_dir / name).read_bytes(), (d, name)
    for group in ("bf16", "fp8"):
        assert "accepted" in (run_dir / "logs" / f"{group}-0.log").read_text()
