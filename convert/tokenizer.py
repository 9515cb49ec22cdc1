"""Tokenizers: load an HF ``tokenizer.json``, or build the character-level one the local runs use.

The character tokenizer is a real ``tokenizers.Tokenizer`` (a WordLevel model over single
characters), saved as ``tokenizer.json`` next to the weights, so every part of the system loads
it the way it would load a production tokenizer.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Digits, letters, whitespace and the punctuation the synthetic tasks and tool calls need.
# Control tokens of the tool environment's turn format (envs.tool).
TOOL_TAGS = ("<tool>", "</tool>", "<out>", "</out>", "<submit>", "</submit>")
DEFAULT_ALPHABET = string.digits + string.ascii_letters + " \n" + "+-*/=()<>[]{}.,:;!?'\"_#$%&|@^~`\\"


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET,
                   extra_special: tuple[str, ...] = TOOL_TAGS) -> Tokenizer:
    """A tokenizer with one id per special token (first) and per character of ``alphabet``.

    ``extra_special`` adds whole-string tokens (e.g. tool-call tags) that are never split.
    """
    if len(set(alphabet)) != len(alphabet):
        raise ValueError("alphabet has repeated characters")
    specials = list(SPECIAL_TOKENS) + list(extra_special)
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load ``tokenizer.json`` from a file or from a model directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.exists():
        raise FileNotFoundError(f"no tokenizer.json at {p}")
    return Tokenizer.from_file(str(p))


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """``{"pad": id, "bos": id, "eos": id}`` for the tokens this tokenizer has."""
    ids = {}
    for key, token in (("pad", PAD), ("bos", BOS), ("eos", EOS)):
        tid = tok.token_to_id(token)
        if tid is not None:
            ids[key] = tid
    return ids
