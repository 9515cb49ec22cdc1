import json

import pytest

from convert.tokenizer import load_chat_template, load_tokenizer, save_tokenizer_files, stop_token_ids
from envs.chat import Chat, ChatTemplateError


def test_render_generation_prompt_and_template_kwargs(model_dir):
    tok = load_tokenizer(model_dir)
    chat = Chat.from_tokenizer(tok, {"enable_thinking": False})
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    text = chat.render(messages, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = chat.render(messages, add_generation_prompt=True, enable_thinking=True)
    assert not thinking.endswith("</think>\n\n")
    ids = chat.prompt_ids(messages)
    assert ids[0] == tok.token_to_id("<|im_start|>") and tok.decode(ids, skip_special_tokens=False) == text


def test_stop_tokens_from_generation_config_and_tokenizer(model_dir):
    tok = load_tokenizer(model_dir)
    assert stop_token_ids(tok) == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    (model_dir / "chat_template.jinja").write_text("{{ 'J' }}")  # the .jinja file wins over the config
    try:
        assert load_chat_template(model_dir) == "{{ 'J' }}"
    finally:
        (model_dir / "chat_template.jinja").unlink()


def test_template_errors_are_one_line(model_dir):
    tok = load_tokenizer(model_dir)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        Chat(tok, "{% if %}")
    with pytest.raises(ChatTemplateError, match="no system"):
        Chat(tok, "{{ raise_exception('no system') }}").render([])


def test_turn_ids_never_retokenize_the_models_reply(model_dir):
    """The model's reply keeps its ids even where re-rendering the conversation would not: a
    non-canonical split merges differently, and the template strips the earlier thinking block."""
    tok = load_tokenizer(model_dir)
    chat = Chat.from_tokenizer(tok)
    end = tok.token_to_id("<|im_end|>")
    user = [{"role": "user", "content": "hello"}]
    prompt = chat.prompt_ids(user)
    # "<think>think</think>hello" with "hello" spelt as single bytes: a canonical encoding merges them.
    reply_text = "<think>think</think>hello"
    reply = chat.encode("<think>think</think>") + [tok.token_to_id(c) for c in "hello"] + [end]
    assert tok.decode(reply[:-1], skip_special_tokens=False) == reply_text
    tool = [{"role": "tool", "content": "hello world"}]
    episode = prompt + reply + chat.turn_ids(tool)
    assert episode[len(prompt): len(prompt) + len(reply)] == reply  # untouched
    # The whole conversation rendered and tokenized again is a different sequence: the thinking
    # block is gone and "hello" merges.
    rerendered = chat.prompt_ids(user + [{"role": "assistant", "content": reply_text}] + tool)
    assert rerendered != episode
    assert "<think>" not in tok.decode(rerendered, skip_special_tokens=False)
    # What follows the reply is exactly the template's text after an assistant turn.
    tail = tok.decode(chat.turn_ids(tool), skip_special_tokens=False)
    assert tail == ("\n<|im_start|>user\n<tool_response>\nhello world\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_saved_tokenizer_files_are_the_sources_bytes(model_dir, tmp_path):
    tok = load_tokenizer(model_dir)
    names = save_tokenizer_files(tok, tmp_path / "out")
    assert set(names) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    for n in names:
        assert (tmp_path / "out" / n).read_bytes() == (model_dir / n).read_bytes()
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["chat_template"]


def test_renders_like_transformers_apply_chat_template(model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    chat = Chat.from_tokenizer(load_tokenizer(model_dir))
    tools = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                    {"role": "assistant", "content": "<think>hmm</think>hi"},
                    {"role": "tool", "content": "out"}]
    for kwargs in ({}, {"enable_thinking": False}):
        for add in (True, False):
            want = hf.apply_chat_template(conversation, tools=tools, add_generation_prompt=add,
                                          tokenize=False, **kwargs)
            assert chat.render(conversation, tools=tools, add_generation_prompt=add, **kwargs) == want
