import pytest

from convert.tokenizer import DEFAULT_ALPHABET, TOOL_TAGS, char_tokenizer, load_tokenizer, special_token_ids


def test_char_tokenizer_round_trips_and_keeps_special_tokens_whole(tmp_path):
    tok = char_tokenizer()
    text = "12+30=42\n<tool>ls -la</tool>"
    enc = tok.encode(text)
    assert "<tool>" in enc.tokens and len(enc.ids) == len(text) - len("<tool>") - len("</tool>") + 2
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    tok.save(str(tmp_path / "tokenizer.json"))
    again = load_tokenizer(tmp_path)
    assert again.encode(text).ids == enc.ids
    ids = special_token_ids(again)
    assert ids == {"pad": 0, "bos": 1, "eos": 2}
    assert again.get_vocab_size() == 4 + len(TOOL_TAGS) + len(DEFAULT_ALPHABET)


def test_unknown_characters_map_to_unk_and_errors():
    tok = char_tokenizer("ab")
    assert tok.encode("abz").ids[-1] == tok.token_to_id("<unk>")
    with pytest.raises(ValueError, match="repeated"):
        char_tokenizer("aa")
    with pytest.raises(FileNotFoundError):
        load_tokenizer("/nonexistent")
