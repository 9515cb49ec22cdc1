"""Tokenizers: load an HF ``tokenizer.json``, or build the character-level one the local runs use.

The character tokenizer is a real ``tokenizers.Tokenizer`` (a WordLevel model over single
characters), saved as ``tokenizer.json`` next to the weights, so every part of the system loads
it the way it would load a production tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
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


# The attribute ``load_tokenizer`` sets on a tokenizer loaded from a model directory: the chat
# template, generation config and special-token names live in files beside ``tokenizer.json``,
# and both sides (trainer and sampler) reach them from the tokenizer they already pass around.
SOURCE_DIR_ATTR = "mixrl_source_dir"
# The files a model directory's chat depends on, carried unchanged into the run and every export.
CHAT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "chat_template.jinja")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load ``tokenizer.json`` from a file or from a model directory (remembered as its source)."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.exists():
        raise FileNotFoundError(f"no tokenizer.json at {p}")
    tok = Tokenizer.from_file(str(p))
    setattr(tok, SOURCE_DIR_ATTR, str(p.parent))
    return tok


def source_dir(tok: Tokenizer) -> Path | None:
    """The directory ``tok`` was loaded from (None for a tokenizer built in memory)."""
    d = getattr(tok, SOURCE_DIR_ATTR, None)
    return Path(d) if d else None


def save_tokenizer_files(tok: Tokenizer, out_dir: str | os.PathLike) -> list[str]:
    """Write ``tok`` into ``out_dir``: the source directory's files copied byte for byte (so an
    engine pointed at an export renders the same chat), else a fresh ``tokenizer.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = source_dir(tok)
    names = [n for n in CHAT_FILES if src is not None and (src / n).is_file()]
    for name in names:
        shutil.copyfile(src / name, out / name)
    if "tokenizer.json" not in names:
        tok.save(str(out / "tokenizer.json"))
        names.append("tokenizer.json")
    return names


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(model_dir: str | os.PathLike) -> str | None:
    """The chat template of a model directory: ``chat_template.jinja``, else ``chat_template`` in
    ``tokenizer_config.json`` (the default one when it is a list of named templates); None if absent."""
    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    template = _read_json(d / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def template_special_tokens(model_dir: str | os.PathLike) -> dict[str, str]:
    """``{"bos_token": ..., "eos_token": ..., ...}`` as ``tokenizer_config.json`` names them (the
    variables a chat template may read)."""
    cfg = _read_json(Path(model_dir) / "tokenizer_config.json")
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        text = _token_text(cfg.get(key))
        if text is not None:
            out[key] = text
    return out


def stop_token_ids(tok: Tokenizer, model_dir: str | os.PathLike | None = None) -> tuple[int, ...]:
    """Ids that end a reply: ``eos_token_id`` of ``generation_config.json`` (an int or a list) and the
    tokenizer's ``eos_token`` (Qwen3: ``<|im_end|>``, ``<|endoftext|>``); ``<eos>`` for the char tokenizer."""
    d = Path(model_dir) if model_dir is not None else source_dir(tok)
    ids: list[int] = []
    if d is not None:
        eos = _read_json(d / "generation_config.json").get("eos_token_id")
        ids += [int(i) for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)]
        text = template_special_tokens(d).get("eos_token")
        if text is not None and tok.token_to_id(text) is not None:
            ids.append(tok.token_to_id(text))
    if not ids and tok.token_to_id(EOS) is not None:
        ids.append(tok.token_to_id(EOS))
    return tuple(dict.fromkeys(ids))


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """``{"pad": id, "bos": id, "eos": id}`` for the tokens this tokenizer has."""
    ids = {}
    for key, token in (("pad", PAD), ("bos", BOS), ("eos", EOS)):
        tid = tok.token_to_id(token)
        if tid is not None:
            ids[key] = tid
    return ids
