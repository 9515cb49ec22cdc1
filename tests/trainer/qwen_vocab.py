"""The real Qwen vocabulary as an HF ``tokenizer.json``: the 151,643 byte-level BPE ranks the
``dashscope`` package ships (``dashscope/resources/qwen.tiktoken``), Qwen2's pre-tokenizer split
pattern, Qwen3's special tokens, and a ChatML-style template of our own."""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3's added tokens from id 151,643 on, in order; the model pads the vocabulary to 151,936.
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                  "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                  "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>",
                  "</think>"]
MODEL_VOCAB = 151_936
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")


@functools.cache
def _byte_chars() -> dict[int, str]:
    # The byte -> printable character map of byte-level BPE (GPT-2's), so every byte is a symbol.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that makes each multi-byte token: BPE over its bytes with the lower ranks only."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i: i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best = min(range(len(parts) - 1),
                       key=lambda i: ranks.get(parts[i] + parts[i + 1], rank))
            if ranks.get(parts[best] + parts[best + 1], rank) >= rank:
                break
            parts[best: best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def qwen_tokenizer_dir(out: Path) -> Path:
    import dashscope
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    path = Path(dashscope.__file__).parent / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    assert len(ranks) == 151_643
    chars = _byte_chars()
    text = lambda b: "".join(chars[x] for x in b)  # noqa: E731
    vocab = {text(t): r for t, r in ranks.items()}
    merges = [(text(a), text(b)) for a, b in _merges(ranks)]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(s, special=s.startswith("<|"), normalized=False) for s in QWEN3_SPECIALS])
    assert tok.token_to_id("<|im_end|>") == 151_645 and tok.token_to_id("</think>") == 151_668
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [151_645, 151_643]}))
    return out
