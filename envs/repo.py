"""``repo``: a multi-turn coding task. Fix the planted bugs of a small generated package with tools.

Each task (``envs.repo_tasks``) is a package of two or three modules whose tests fail. The model
speaks its own tool protocol (tools declared through the chat template, calls as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, results as the template's ``tool``
turn; ``envs.tool_calls`` explains why the reply is never re-rendered) with five tools:
``read_file``, ``replace`` (one exact occurrence of a string), ``replace_lines`` (a line range),
``run_tests`` and ``submit``. Every tool runs inside the episode's sandbox as a small
standard-library script (``envs.repo_tools.TOOL_SCRIPT``), so nothing the model names or writes is
touched by this process.

An episode ends on ``submit``, at ``max_turns``, after three turns in a row without a tool call
(the write-up's rule), on a reply cut by the length limit, or when the next observation would
leave no room for a reply within ``episode_tokens`` (termination ``length``). On *every* ending
the reward is the share of the task's tests that pass on the package as the model left it,
graded by ``envs.repo_tools.grade_package`` as the hardened ``code`` reward grades: the expected
values stay outside the jail and only plain values come out of it, so no byte of the model's
output can raise out of grading or claim a test it did not pass.

Needs a tokenizer with a chat template (a model directory): the character tokenizer has no tool
protocol for this task.
"""

from __future__ import annotations

import collections
import json
from typing import Any

import numpy as np

from envs.base import Environment, Episode, StepResult, Task, register_env
from envs.chat import Chat
from envs.repo_tasks import generate
from envs.repo_tools import NUDGE, TOOLS, TrustedDir, grade_package, parse_calls, run_tool
from envs.rollout import segments
from envs.sandbox import Sandbox, SandboxLimits
from envs.tool_calls import _reply_text

MAX_TOOLLESS_TURNS = 3
MAX_CALLS_PER_TURN = 4
MALFORMED = ('error: a tool call must be {"name": one of ' + ", ".join(t["function"]["name"] for t in TOOLS)
             + ', "arguments": {...}} in JSON')


class RepoEpisode(Episode):
    def __init__(self, env: RepoTasks, task: Task, *, trusted: bool = False):
        self.env, self.task, self.chat = env, task, env.chat
        self.kwargs = dict(task.payload.get("chat_template_kwargs") or {})
        self.prompt = env.prompt(task)
        self.stop_token_ids = self.chat.stop_ids
        # trusted: the scripted demonstration (our own package, no model output) runs unjailed.
        self.sandbox = TrustedDir() if trusted else env.new_sandbox(task)
        for name, content in task.payload["files"].items():
            self.sandbox.write_file(name, content)
        self.turns = self.toolless = 0
        self.length = len(self.prompt)
        self.budget = len(self.prompt) + int(task.payload.get("episode_tokens", env.episode_tokens))
        self.reserve = int(task.payload.get("reply_reserve", env.reply_reserve))
        self.outcomes: collections.Counter = collections.Counter()  # tool -> ok / error counts

    def close(self) -> None:
        self.sandbox.close()

    def _next(self, messages: list[dict]) -> list[int]:
        return self.chat.turn_ids(messages, tools=TOOLS, **self.kwargs)

    def _end(self, termination: str) -> StepResult:
        return StepResult([], self.env.grade(self), True, termination)

    def step(self, generated: list[int]) -> StepResult:
        self.turns += 1
        self.length += len(generated)
        text, ended = _reply_text(self.chat, generated)
        if not ended:
            return self._end("length")  # cut mid-reply: graded as it stands
        calls, malformed = parse_calls(text)
        results: list[dict[str, Any]] = []
        for call in calls[:MAX_CALLS_PER_TURN]:
            if call["name"] == "submit":
                return self._end("submitted")
            results.append({"role": "tool", "content": self.call(call)})
        if calls:
            self.toolless = 0
        elif malformed:
            self.toolless = 0
            self.outcomes["malformed"] += malformed
            results = [{"role": "tool", "content": MALFORMED}]
        else:
            self.toolless += 1
            if self.toolless >= MAX_TOOLLESS_TURNS:
                return self._end("toolless_stop" if text.strip() else "empty_reply")
            results = [{"role": "user", "content": NUDGE}]
        if self.turns >= int(self.task.payload.get("max_turns", self.env.max_turns)):
            return self._end("turn_limit")
        observation = self._next(results)
        if self.length + len(observation) + self.reserve > self.budget:
            return self._end("length")
        self.length += len(observation)
        return StepResult(observation, 0.0, False)

    def call(self, call: dict) -> str:
        """One tool call's result text (errors are results too: the model reads them)."""
        output, ok = run_tool(self.sandbox, call, self.note_error, self.chat.tokenizer)
        self.outcomes[f"{call['name']}/{'ok' if ok else 'error'}"] += 1
        return _truncate(output, int(self.task.payload.get("max_observation_chars",
                                                            self.env.max_observation_chars)))

    def demonstration(self) -> tuple[list[int], list[int]]:
        """Run the tests, read the first buggy module, replace each bug's snippet, run the tests again,
        submit: each call
        made for real in the sandbox, so the observations are what the model will see."""
        ids, mask = list(self.prompt), [0] * len(self.prompt)
        bugs = self.task.payload["bugs"]
        plan = [("run_tests", {}), ("read_file", {"path": bugs[0]["path"]})]
        plan += [("replace", {"path": b["path"], "old": b["buggy"], "new": b["correct"]}) for b in bugs]
        plan += [("run_tests", {}), ("submit", {})]
        stop = self.chat.stop_ids[0]
        calls = [{"name": name, "arguments": args} for name, args in plan[:-1]]
        if isinstance(self.sandbox, TrustedDir):  # one interpreter for every call
            limit = int(self.task.payload.get("max_observation_chars", self.env.max_observation_chars))
            results = [_truncate(r, limit) for r in self.sandbox.run_calls(calls)]
        else:
            results = [self.call(c) for c in calls]
        for i, (name, args) in enumerate(plan):
            body = json.dumps({"name": name, "arguments": args})
            call = self.chat.encode(f"<tool_call>\n{body}\n</tool_call>")
            ids += call + [stop]
            mask += [1] * (len(call) + 1)
            if name != "submit":
                obs = self._next([{"role": "tool", "content": results[i]}])
                ids += obs
                mask += [0] * len(obs)
        return ids, mask


def _truncate(output: str, limit: int) -> str:
    return output if len(output) <= limit else output[:limit] + "\n[output truncated]"


@register_env
class RepoTasks(Environment):
    """Generated packages with failing tests, fixed through tool calls (module docstring)."""

    name = "repo"

    def __init__(self, tokenizer, difficulty: int = 1, *, max_turns: int = 12, episode_tokens: int = 4096,
                 reply_reserve: int = 64, max_observation_chars: int = 3000,
                 limits: SandboxLimits | None = None, allow_unisolated: bool = False,
                 allow_unbounded_memory: bool = False):
        super().__init__(tokenizer, difficulty)
        self.chat = Chat.from_tokenizer(tokenizer)
        if self.chat is None:
            raise ValueError("repo: needs a tokenizer with a chat template (a model directory's "
                             "tokenizer, model.hf_dir): the tool calls are in the model's own format")
        for key, value in (("max_turns", max_turns), ("episode_tokens", episode_tokens),
                           ("max_observation_chars", max_observation_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"repo: {key} must be an integer >= 1, got {value!r}")
        self.max_turns, self.episode_tokens, self.reply_reserve = max_turns, episode_tokens, reply_reserve
        self.max_observation_chars = max_observation_chars
        self.limits = limits or SandboxLimits(wall_seconds=5.0, cpu_seconds=5, max_output_bytes=16384)
        self.allow_unisolated, self.allow_unbounded_memory = allow_unisolated, allow_unbounded_memory

    def new_sandbox(self, task: Task) -> Sandbox:
        """An episode's sandbox (the memory opt-out travels with the task, as ``shell``'s)."""
        return Sandbox(self.limits, allow_unisolated=self.allow_unisolated,
                       allow_unbounded_memory=self.allow_unbounded_memory
                       or bool(task.payload.get("allow_unbounded_memory")))

    def sample_task(self, rng: np.random.Generator, task_id: str) -> Task:
        payload = generate(rng, self.difficulty)
        # Episode rules travel with the task: the sampler's copy of the environment has defaults.
        payload.update(max_turns=self.max_turns, episode_tokens=self.episode_tokens,
                       reply_reserve=self.reply_reserve, max_observation_chars=self.max_observation_chars,
                       chat_template_kwargs=dict(self.chat_template_kwargs))
        if self.allow_unbounded_memory:
            payload["allow_unbounded_memory"] = True
        return Task(task_id, self.name, payload)

    def question(self, task: Task) -> str:
        p = task.payload
        listing = "\n".join(f"- {path}" for path in p["files"])
        return (f"The tests of the Python package `{p['package']}` fail. Find the bugs and fix them with "
                f"the tools: read_file to read a file, replace or replace_lines to edit one, run_tests "
                f"to run every test, submit when they pass.\nFiles:\n{listing}")

    def prompt(self, task: Task) -> list[int]:
        kwargs = dict(task.payload.get("chat_template_kwargs") or {})
        return self.chat.encode(self.chat.render([{"role": "user", "content": self.question(task)}],
                                                 add_generation_prompt=True, tools=TOOLS, **kwargs))

    def longest_prompt(self) -> int:
        """The most prompt tokens over 64 drawn tasks (the prompt varies only with the file list)."""
        return max(len(self.prompt(self.sample_task(np.random.default_rng(i), "longest"))) for i in range(64))

    def start(self, task: Task) -> Episode:
        return RepoEpisode(self, task)

    def grade(self, episode: RepoEpisode) -> float:
        """The share of the task's tests passing on the package as the episode left it."""
        return grade_package(episode.sandbox.workdir, episode.task.payload, self.limits, episode.note_error,
                             allow_unisolated=self.allow_unisolated,
                             allow_unbounded_memory=episode.sandbox.cgroup is None)

    def demonstration(self, task: Task) -> tuple[list[int], list[int]]:
        """The scripted episode (``RepoEpisode.demonstration``), its tools run on our own package
        in a plain temporary directory (``envs.repo_tools.TrustedDir``): no model output runs."""
        with RepoEpisode(self, task, trusted=True) as episode:
            return episode.demonstration()

    def turn_stats(self, token_ids: np.ndarray, loss_mask: np.ndarray) -> dict[str, int]:
        """``envs.tool_calls.turn_stats`` with this task's tools, plus ``call_turns`` (turns with
        at least one well-formed call): ``tool/call_rate`` falls when an agent stops calling tools."""
        return turn_stats(self.chat, token_ids, loss_mask)


def turn_stats(chat: Chat, token_ids: np.ndarray, loss_mask: np.ndarray) -> dict[str, int]:
    stats = {"turns": 0, "malformed_calls": 0, "empty_replies": 0, "toolless_turns": 0, "call_turns": 0,
             "calls": 0}
    for text in policy_turns(chat, token_ids, loss_mask):
        calls, malformed = parse_calls(text)
        stats["turns"] += 1
        stats["calls"] += len(calls)
        stats["call_turns"] += bool(calls)
        stats["malformed_calls"] += malformed
        stats["empty_replies"] += not text.strip()
        stats["toolless_turns"] += bool(text.strip()) and not calls and not malformed
    return stats


def policy_turns(chat: Chat, token_ids: np.ndarray, loss_mask: np.ndarray) -> list[str]:
    """The text of each policy turn (without its stop token)."""
    return [_reply_text(chat, [int(t) for t in token_ids[a:b]])[0]
            for a, b, policy in segments(loss_mask) if policy]


__all__ = ["RepoEpisode", "RepoTasks", "policy_turns", "segments", "turn_stats"]
