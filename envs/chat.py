"""Chat templates, token in / token out.

A model directory's chat template (``chat_template.jinja`` or ``chat_template`` in
``tokenizer_config.json``) is rendered with jinja2 the way the Hugging Face libraries render it
(a sandboxed environment with ``trim_blocks`` / ``lstrip_blocks``, ``tojson``, ``raise_exception``,
the special tokens as variables, ``add_generation_prompt`` and any template arguments such as
Qwen3's ``enable_thinking``).

Multi-turn episodes never re-render or re-tokenize what the model generated: a template may
render an earlier assistant turn differently (Qwen3 strips ``<think>`` blocks), and the model's
token ids need not be the canonical tokenization of their text. ``Chat.turn_ids`` therefore
renders only what follows the model's reply: the text after the end of an assistant turn in a
rendering of a placeholder conversation, up to the next generation prompt, tokenized alone.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from convert.tokenizer import load_chat_template, source_dir, stop_token_ids, template_special_tokens

Message = dict[str, Any]
# What a placeholder assistant turn says: turn_ids cuts the rendering right after it.
_PLACEHOLDER = "\x00mixrl-reply\x00"


class ChatTemplateError(ValueError):
    """The template failed to render (it raised, or the conversation does not fit its rules)."""


@functools.cache
def _compile(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ChatTemplateError(f"chat template: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # As transformers renders it: non-ASCII kept, keys in the caller's order.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


class Chat:
    """A tokenizer's chat: its template, special-token variables and stop tokens."""

    def __init__(self, tokenizer: Tokenizer, template: str, *, special_tokens: dict[str, str] | None = None,
                 stop_ids: Sequence[int] = (), kwargs: dict[str, Any] | None = None):
        self.tokenizer, self.template = tokenizer, template
        self.special_tokens = dict(special_tokens or {})
        self.stop_ids = tuple(stop_ids)
        self.kwargs = dict(kwargs or {})
        _compile(template)  # a broken template fails here, when the environment is built

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, kwargs: dict[str, Any] | None = None) -> Chat | None:
        """The chat of the directory ``tokenizer`` was loaded from, or None without a template."""
        d = source_dir(tokenizer)
        template = load_chat_template(d) if d is not None else None
        if template is None:
            return None
        return cls(tokenizer, template, special_tokens=template_special_tokens(d),
                   stop_ids=stop_token_ids(tokenizer, d), kwargs=kwargs)

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False,
               tools: Sequence[dict] | None = None, **kwargs) -> str:
        """The template's text for ``messages`` (``kwargs`` over the chat's own template arguments)."""
        variables = {**self.special_tokens, **self.kwargs, **kwargs}
        try:
            return _compile(self.template).render(
                messages=list(messages), tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2 errors name the template line; keep them one line
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None

    def encode(self, text: str) -> list[int]:
        # The template writes the special tokens itself; the tokenizer must not add more.
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt_ids(self, messages: Sequence[Message], *, tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt (what the model continues)."""
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    def turn_ids(self, messages: Sequence[Message], *, tools: Sequence[dict] | None = None,
                 **kwargs) -> list[int]:
        """Ids to append after the model's reply (ending at its stop token): ``messages`` (tool
        results, user turns) rendered as the template renders them after an assistant turn, then the
        next generation prompt (``kwargs``: template arguments). The reply itself is never
        rendered, so its ids stay the sampler's."""
        # Only the text after the placeholder reply is used: templates may render the reply's own
        # turn differently once more turns follow (Qwen3 adds an empty thinking block to the last one).
        head = [{"role": "user", "content": "."}, {"role": "assistant", "content": _PLACEHOLDER}]
        after = self.render([*head, *messages], add_generation_prompt=True, tools=tools, **kwargs)
        start = after.find(_PLACEHOLDER)
        if start < 0 or after.count(_PLACEHOLDER) != 1:
            raise ChatTemplateError("chat template does not render an assistant turn's content verbatim")
        end = start + len(_PLACEHOLDER)
        # The assistant turn's closing text (e.g. "<|im_end|>") is what the model generated as its
        # stop token; everything after it is the environment's to append.
        return self.encode(after[end + len(self._closing_text(after[end:])):])

    def _closing_text(self, tail: str) -> str:
        """The stop token's text at the start of ``tail`` (what ends an assistant turn)."""
        for tid in self.stop_ids:
            text = self.tokenizer.id_to_token(tid)
            if text and tail.startswith(text):
                return text
        raise ChatTemplateError("chat template does not end an assistant turn with a stop token "
                                f"({[self.tokenizer.id_to_token(t) for t in self.stop_ids]})")
