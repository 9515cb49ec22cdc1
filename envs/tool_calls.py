"""Tool calls in the model's own format (Qwen3 / Hermes): tools declared through the chat
template's ``tools`` argument, calls written as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``,
results appended as the template's ``tool`` turn (never by re-rendering the model's reply).

``ShellTasks`` uses this protocol when its tokenizer comes with a chat template (a real model's
directory), and its own tag protocol (``envs.tool``) with the character tokenizer.
``turn_stats`` re-reads a finished episode's policy turns on the trainer side and counts what the
seed's collapse looked like: malformed calls, empty replies and turns without a tool call.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

import numpy as np

from envs.base import Episode, StepResult, Task
from envs.chat import Chat
from envs.sandbox import Sandbox
from envs.untrusted import escape_added_tokens, run_untrusted

MAX_TOOLLESS_TURNS = 3
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
NUDGE = "Call a tool: shell to run a command, submit to give the answer."

TOOLS = [
    {"type": "function", "function": {
        "name": "shell", "description": "Run a shell command in the task directory; returns its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "submit", "description": "Submit the final answer; ends the task.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
                       "required": ["answer"]}}},
]


def parse_tool_calls(text: str) -> tuple[list[dict[str, Any]], int]:
    """``([{"name", "arguments"}, ...], malformed)``: the well-formed calls in ``text`` and how many
    ``<tool_call>`` blocks were not JSON objects with a known name and an arguments object."""
    calls, malformed = [], 0
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except (json.JSONDecodeError, RecursionError):  # "[[[[..." nests past the parser's stack
            malformed += 1
            continue
        args = call.get("arguments") if isinstance(call, dict) else None
        known = {t["function"]["name"] for t in TOOLS}
        if not (isinstance(call, dict) and call.get("name") in known and isinstance(args, dict)):
            malformed += 1
            continue
        calls.append({"name": call["name"], "arguments": args})
    # An opened call never closed is malformed too.
    malformed += text.count("<tool_call>") - text.count("</tool_call>") if "<tool_call>" in text else 0
    return calls, malformed


def _reply_text(chat: Chat, generated: list[int]) -> tuple[str, bool]:
    ended = bool(generated) and generated[-1] in chat.stop_ids
    body = generated[:-1] if ended else generated
    return chat.tokenizer.decode(body, skip_special_tokens=False), ended


class ToolTasks(Protocol):
    """What a chat tool episode needs of its environment (``envs.tool.ShellTasks`` is one): the
    episode lives here, below the environment, so the two modules do not import each other."""

    max_turns: int

    def prompt(self, task: Task) -> list[int]: ...

    def new_sandbox(self, task: Task) -> Sandbox: ...

    def grade(self, episode: Episode, submitted: str) -> float: ...


class ChatToolEpisode(Episode):
    def __init__(self, env: ToolTasks, task: Task, chat: Chat):
        self.env, self.task, self.chat = env, task, chat
        self.kwargs = dict(task.payload.get("chat_template_kwargs") or {})
        self.prompt = env.prompt(task)
        self.stop_token_ids = chat.stop_ids
        self.sandbox = env.new_sandbox(task)
        for name, content in task.payload["files"].items():
            self.sandbox.write_file(name, content)
        self.turns = self.toolless = 0

    def close(self) -> None:
        self.sandbox.close()

    def _next(self, messages: list[dict]) -> list[int]:
        return self.chat.turn_ids(messages, tools=TOOLS, **self.kwargs)

    def step(self, generated: list[int]) -> StepResult:
        self.turns += 1
        text, ended = _reply_text(self.chat, generated)
        if not ended:
            return StepResult([], 0.0, True, "length")  # cut mid-reply: no turn can follow it
        calls, malformed = parse_tool_calls(text)
        for call in calls:
            if call["name"] == "submit":
                answer = str(call["arguments"].get("answer", ""))
                return StepResult([], self.env.grade(self, answer), True, "submitted")
        if calls:
            self.toolless = 0
            results = [{"role": "tool", "content": self._run(str(c["arguments"].get("command", "")))}
                       for c in calls]
        elif malformed:
            self.toolless = 0
            results = [{"role": "tool", "content": "error: a tool call must be "
                        '{"name": "shell" or "submit", "arguments": {...}} in JSON'}]
        else:
            self.toolless += 1
            if self.toolless >= MAX_TOOLLESS_TURNS:
                return StepResult([], 0.0, True, "toolless_stop" if text.strip() else "empty_reply")
            results = [{"role": "user", "content": NUDGE}]
        if self.turns >= int(self.task.payload.get("max_turns", self.env.max_turns)):
            return StepResult([], 0.0, True, "turn_limit")
        return StepResult(self._next(results), 0.0, False)

    def _run(self, command: str) -> str:
        output, marker = run_untrusted(self.sandbox, command, self.note_error)
        # The template renders this text and the whole turn is encoded: an added token in it
        # (``<|im_end|>``, ``</tool_response>``) would reach the model as that token.
        output, escaped = escape_added_tokens(self.chat.tokenizer, output)
        if escaped:
            self.note_error("special_tokens")
        return output[: int(self.task.payload.get("max_observation_chars", 512))] + marker

    def demonstration(self) -> tuple[list[int], list[int]]:
        """The solution command called for real, then the expected answer submitted."""
        ids, mask = list(self.prompt), [0] * len(self.prompt)
        solution, check = self.task.payload["solution"], self.task.payload["check"]
        stop = self.chat.stop_ids[0]
        for name, args in (("shell", {"command": solution}),
                           ("submit", {"answer": check["value"] if check["kind"] == "answer" else "done"})):
            body = json.dumps({"name": name, "arguments": args})
            call = self.chat.encode(f"<tool_call>\n{body}\n</tool_call>")
            ids += call + [stop]
            mask += [1] * (len(call) + 1)
            if name == "shell":
                obs = self._next([{"role": "tool", "content": self._run(solution)}])
                ids += obs
                mask += [0] * len(obs)
        return ids, mask


def turn_stats(chat: Chat, token_ids: np.ndarray, loss_mask: np.ndarray) -> dict[str, int]:
    """Per episode: policy ``turns``, ``malformed_calls``, ``empty_replies`` and ``toolless_turns``
    (replies with neither a well-formed nor a malformed call), read from the tokens."""
    stats = {"turns": 0, "malformed_calls": 0, "empty_replies": 0, "toolless_turns": 0}
    mask = np.asarray(loss_mask).astype(bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
    for start, end in zip(edges[::2], edges[1::2], strict=True):
        text, _ = _reply_text(chat, [int(t) for t in token_ids[start:end]])
        calls, malformed = parse_tool_calls(text)
        stats["turns"] += 1
        stats["malformed_calls"] += malformed
        stats["empty_replies"] += not text.strip()
        stats["toolless_turns"] += bool(text.strip()) and not calls and not malformed
    return stats
