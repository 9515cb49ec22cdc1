#!/usr/bin/env python
"""A tiny random Qwen3 model directory with a real tokenizer and chat template, for
``configs/local_agentic.yaml`` on a CPU (the ``repo`` task needs a model's tool-call format).

    .venv/bin/python scripts/make_tiny_chat_model.py runs/tiny-chat-model

Writes a byte-level BPE ``tokenizer.json`` (512 ids) trained on ``repo`` tasks' files and tool
calls, a ChatML template that declares tools and renders tool results as Qwen3's does
(``<tool_response>`` in a user turn, ``enable_thinking``), a generation config naming both stop
tokens, and random weights of a 2-layer, 64-wide Qwen3. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
            "</tool_call>", "<tool_response>", "</tool_response>"]

TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
You may call one or more functions. The functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}

<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
             max_position_embeddings=8192)


def corpus(n: int = 300) -> list[str]:
    """Text the tokenizer learns its merges from: generated tasks' files, the tools' JSON and
    the calls a demonstration makes."""
    import numpy as np

    from envs.repo_tasks import generate
    from envs.repo_tools import TOOLS

    texts = [json.dumps(t) for t in TOOLS] * 5
    for seed in range(n):
        p = generate(np.random.default_rng(seed))
        texts += list(p["files"].values())
        for b in p["bugs"]:
            texts.append(json.dumps({"name": "replace", "arguments": {"path": b["path"], "old": b["buggy"],
                                                                      "new": b["correct"]}}))
            texts.append(json.dumps({"name": "read_file", "arguments": {"path": b["path"]}}))
        texts.append('{"name": "run_tests", "arguments": {}}\n{"name": "submit", "arguments": {}}')
    return texts


def make(out: Path, *, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=MODEL["vocab_size"], special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    out.mkdir(parents=True, exist_ok=False)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,  # as Qwen3's
         "chat_template": TEMPLATE}))  # (transformers would take <|endoftext|>, and renderers refuse it)
    ids = {name: tok.token_to_id(name) for name in ("<|im_end|>", "<|endoftext|>")}
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**MODEL, bos_token_id=ids["<|endoftext|>"],
                                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]))
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="directory to create (must not exist)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.out.exists():
        print(f"make_tiny_chat_model: {args.out} already exists; name a new directory", file=sys.stderr)
        return 2
    make(args.out, seed=args.seed)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
