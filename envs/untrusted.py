"""What the tool environments do with bytes that came from the model or from its jail.

A model's command is refused as an observation (never an exception) when it cannot be run: a NUL
byte (no ``execve`` argument can hold one) or more than ``MAX_COMMAND_BYTES`` (the sandbox passes
the command as one environment string, and Linux caps a single string at 128 KiB,
``MAX_ARG_STRLEN``; 64 KiB leaves room for the rest of the environment and is far beyond any
real tool call). Output is text decoded with replacement.

Observation text must not become control tokens: a tokenizer's added tokens (``<|im_end|>``,
``<tool_call>``, the character tokenizer's ``<submit>``) are matched in any text it encodes, and
``tokenizers`` has no switch to encode them as plain text. ``escape_added_tokens`` breaks every
occurrence with a zero-width space after its first character (a backslash for a tokenizer that
cannot encode one), so the model reads the same characters and the ids are never the token's.
"""

from __future__ import annotations

import functools
import itertools
import re
import subprocess
from collections.abc import Callable

from tokenizers import Tokenizer

#: Longest command run in the sandbox, in UTF-8 bytes (Linux's MAX_ARG_STRLEN is 131072).
MAX_COMMAND_BYTES = 64 * 1024
_BREAKS = ("\u200b", "\\")


def run_untrusted(sandbox, command: str, note_error: Callable[[str], None]) -> tuple[str, str]:
    """``(output, marker)`` of ``command`` in ``sandbox``; ``marker`` is ``"[timed out]"``,
    ``"[output truncated]"`` or ``""``. A command that cannot run gives a one-line refusal as its
    output and counts a reason with ``note_error`` (``nul_command``, ``long_command``,
    ``command_failed``)."""
    if "\0" in command:
        note_error("nul_command")
        return "error: the command contains a NUL byte; refused", ""
    size = len(command.encode("utf-8", errors="surrogatepass"))
    if size > MAX_COMMAND_BYTES:
        note_error("long_command")
        return f"error: the command is {size} bytes, over the {MAX_COMMAND_BYTES}-byte limit; refused", ""
    try:
        result = sandbox.run(command)
    except (OSError, ValueError, UnicodeError, subprocess.SubprocessError) as e:
        note_error("command_failed")
        return f"error: the command could not run ({type(e).__name__})", ""
    output = result.output
    if isinstance(output, bytes):
        output = output.decode("utf-8", errors="replace")
    output = output.replace("\0", "\ufffd")  # a NUL is no text (and chat.py's placeholder holds one)
    marker = "[timed out]" if result.timed_out else "[output truncated]" if result.output_truncated else ""
    return output, marker


@functools.lru_cache(maxsize=16)
def _pattern(tokens: tuple[str, ...]) -> re.Pattern | None:
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def _added_tokens(tokenizer: Tokenizer) -> tuple[tuple[str, ...], str]:
    """The tokenizer's multi-character added tokens and the break character it can encode."""
    added = tokenizer.get_added_tokens_decoder()
    tokens = tuple(sorted({t.content for t in added.values() if len(t.content) > 1}))
    for brk in _BREAKS:
        if not set(tokenizer.encode(brk, add_special_tokens=False).ids) & set(added):
            return tokens, brk
    return tokens, ""


def escape_added_tokens(tokenizer: Tokenizer, text: str) -> tuple[str, int]:
    """``(text, n)``: ``text`` with each of the ``n`` occurrences of an added token broken so it
    encodes as plain text (removed, for a tokenizer that can encode no break character)."""
    tokens, brk = _added_tokens(tokenizer)
    pattern = _pattern(tokens)
    total = 0
    if pattern is None:
        return text, 0
    # A break (for a pathological vocabulary) or a removal can join the text around an
    # occurrence into a new one: break a few rounds, then remove until none is left (each
    # removal shortens the text, so this ends).
    for attempt in itertools.count():
        mark = brk if attempt < 4 else ""
        text, n = pattern.subn(lambda m, mark=mark: m.group(0)[0] + mark + m.group(0)[1:] if mark else "",
                               text)
        total += n
        if not n:
            break
    return text, total


__all__ = ["MAX_COMMAND_BYTES", "escape_added_tokens", "run_untrusted"]
