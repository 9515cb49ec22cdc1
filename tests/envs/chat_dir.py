"""A model directory with a small byte-level BPE tokenizer trained here and a ChatML-style template
of our own (earlier assistant turns lose their ``<think>`` block, as Qwen3's do)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
            "</tool_call>"]

TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- set content = message.content %}
{%- if message.role == 'assistant' and not loop.last and '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- elif message.role == 'assistant' and loop.last and '</think>' not in content %}
{%- set content = '<think>\\n\\n</think>\\n\\n' + content %}
{%- endif %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

CORPUS = ["what is 2 + 3? the answer is 5.", "hello world, hello there", "think about it step by step",
          "<tool_response>", "</tool_response>", "user assistant system tool", "boxed answer #### 42"] * 20


def make_model_dir(path: Path, *, template: str = TEMPLATE) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template}))
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path
