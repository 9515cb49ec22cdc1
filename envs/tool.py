"""A multi-turn tool environment: shell commands in a sandbox, hidden checks on submit.

Turn format (tags are single special tokens of the tokenizer, ``TOOL_TAGS``):

    <bos>{question}\\n                      prompt
    <tool>cat a.txt</tool>                  policy turn (generation stops at </tool>)
    <out>17\\n</out>\\n                       observation (loss-masked)
    <submit>17</submit>                     policy turn: ends the episode

With a real model's tokenizer (one that comes with a chat template) the environment speaks the
model's own tool protocol instead: ``envs.tool_calls``.

The command runs in a fresh ``Sandbox`` per episode. The episode ends on a submit (reward 1 if
the hidden check passes), at the turn limit, or after three consecutive turns without a tool call
(the agent-harness rule of the seed experiment); an empty last reply is recorded as
``empty_reply``, other tool-less endings as ``toolless_stop``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from convert.tokenizer import TOOL_TAGS
from envs.base import Environment, Episode, StepResult, Task, register_env
from envs.chat import Chat
from envs.jail_files import JailFileError, read_jail_text
from envs.sandbox import Sandbox, SandboxLimits
from envs.tool_calls import TOOLS, ChatToolEpisode
from envs.untrusted import escape_added_tokens, run_untrusted

TOOL_OPEN, TOOL_CLOSE, OUT_OPEN, OUT_CLOSE, SUBMIT_OPEN, SUBMIT_CLOSE = TOOL_TAGS
MAX_TOOLLESS_TURNS = 3


class ToolEpisode(Episode):
    def __init__(self, env: ShellTasks, task: Task):
        self.env, self.task = env, task
        self.prompt = env.prompt(task)
        tid = env.tokenizer.token_to_id
        self.stop_token_ids = (tid(TOOL_CLOSE), tid(SUBMIT_CLOSE), env.eos)
        self.sandbox = env.new_sandbox(task)
        for name, content in task.payload["files"].items():
            self.sandbox.write_file(name, content)
        self.turns = 0
        self.toolless = 0

    def close(self) -> None:
        self.sandbox.close()

    def run_tool(self, command: str) -> list[int]:
        output, marker = run_untrusted(self.sandbox, command, self.note_error)
        return self.env.observation(output + marker, self.task.payload.get("max_observation_chars"),
                                    note_error=self.note_error)

    def step(self, generated: list[int]) -> StepResult:
        self.turns += 1
        text = self.env.decode(generated)
        submitted = _tagged(text, SUBMIT_OPEN, SUBMIT_CLOSE)
        if submitted is not None:
            return StepResult([], self.env.grade(self, submitted), True, "submitted")
        command = _tagged(text, TOOL_OPEN, TOOL_CLOSE)
        if command is not None:
            self.toolless = 0
            observation = self.run_tool(command)
        else:
            self.toolless += 1
            if self.toolless >= MAX_TOOLLESS_TURNS:
                body = [t for t in generated if t != self.env.eos]
                return StepResult([], 0.0, True, "toolless_stop" if body else "empty_reply")
            observation = self.env.encode("\n")
        if self.turns >= int(self.task.payload.get("max_turns", self.env.max_turns)):
            return StepResult([], 0.0, True, "turn_limit")
        return StepResult(observation, 0.0, False)


def _tagged(text: str, open_tag: str, close_tag: str) -> str | None:
    """The text between the last ``open_tag`` and a ``close_tag`` that ends the turn."""
    if not text.endswith(close_tag) or open_tag not in text:
        return None
    return text[text.rindex(open_tag) + len(open_tag): -len(close_tag)]


@register_env
class ShellTasks(Environment):
    """File tasks solved with shell commands. Families (payload ``family``):

    - ``lookup``: n files ``k{i}.txt`` hold random numbers; submit the content of one of them.
    - ``sum``: submit the sum of the numbers in ``a.txt`` and ``b.txt``.
    - ``write``: create ``out.txt`` holding a given word; checked by reading the file.
    """

    name = "shell"
    families = ("lookup", "sum", "write")

    def __init__(self, tokenizer, difficulty: int = 1, *, max_turns: int = 4, max_observation_chars: int = 48,
                 limits: SandboxLimits | None = None, allow_unisolated: bool = False,
                 families: tuple[str, ...] | None = None, allow_unbounded_memory: bool = False):
        super().__init__(tokenizer, difficulty)
        # Where no cgroup can bound a sandbox, the config is refused at load (TasksConfig) and each
        # sandbox refuses to start, unless this opt-out (which travels with the task) is set. Not
        # checked here: a sampler builds its copy of the environment with defaults.
        self.allow_unbounded_memory = allow_unbounded_memory
        self.chat = Chat.from_tokenizer(tokenizer)
        missing = [t for t in TOOL_TAGS if tokenizer.token_to_id(t) is None]
        if missing and self.chat is None:
            raise ValueError(f"tokenizer lacks the tool tags {missing}")
        self.max_turns, self.max_observation_chars = max_turns, max_observation_chars
        self.limits = limits or SandboxLimits(wall_seconds=2.0, cpu_seconds=2)
        self.allow_unisolated = allow_unisolated
        self.families = tuple(families or self.families)
        unknown = sorted(set(self.families) - set(ShellTasks.families))
        if unknown:  # sample_task would make `write` tasks of them (the config refuses them first)
            raise ValueError(f"shell: unknown families {unknown}; known: {', '.join(ShellTasks.families)}")

    def new_sandbox(self, task: Task) -> Sandbox:
        """An episode's sandbox. The memory opt-out travels with the task: a sampler builds its
        copy of the environment with defaults."""
        return Sandbox(self.limits, allow_unisolated=self.allow_unisolated,
                       allow_unbounded_memory=self.allow_unbounded_memory
                       or bool(task.payload.get("allow_unbounded_memory")))

    def sample_task(self, rng: np.random.Generator, task_id: str) -> Task:
        family = str(rng.choice(list(self.families)))
        digits = 1 + self.difficulty
        number = lambda: str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
        if family == "lookup":
            files = {f"k{i}.txt": number() + "\n" for i in range(1 + self.difficulty)}
            key = str(rng.choice(sorted(files)))
            payload = {"question": f"what is in {key}?", "files": files,
                       "check": {"kind": "answer", "value": files[key].strip()}, "solution": f"cat {key}"}
        elif family == "sum":
            a, b = number(), number()
            payload = {"question": "submit a.txt + b.txt",
                       "files": {"a.txt": a + "\n", "b.txt": b + "\n"},
                       "check": {"kind": "answer", "value": str(int(a) + int(b))},
                       "solution": "cat a.txt b.txt"}
        else:
            word = "".join(chr(ord("a") + int(i)) for i in rng.integers(0, 26, 2 + self.difficulty))
            payload = {"question": f"write {word} to out.txt", "files": {},
                       "check": {"kind": "file", "path": "out.txt", "value": word},
                       "solution": f"echo {word} > out.txt"}
        # Episode rules travel with the task: the sampler's copy of the environment may be built
        # with defaults.
        if self.allow_unbounded_memory:
            payload["allow_unbounded_memory"] = True
        payload.update(family=family, max_turns=self.max_turns,
                       max_observation_chars=self.max_observation_chars)
        if self.chat is not None:
            payload["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        return Task(task_id, self.name, payload)

    def prompt(self, task: Task) -> list[int]:
        """The ids an episode of ``task`` starts from: ``<bos>question\n`` for the character
        tokenizer, else the question as a user turn through the model's chat template with the
        ``shell`` / ``submit`` tools declared and the task's template arguments."""
        question = task.payload["question"]
        if self.chat is None:
            return [self.bos] + self.encode(question + "\n")
        kwargs = dict(task.payload.get("chat_template_kwargs") or {})
        return self.chat.encode(self.chat.render([{"role": "user", "content": question}],
                                                 add_generation_prompt=True, tools=TOOLS, **kwargs))

    def longest_prompt(self) -> int:
        """The most prompt tokens a task can have (``trainer_jax.batch_shape`` budgets rows by it),
        over the questions of 256 drawn tasks: a question's length depends only on its family and
        ``difficulty``, and no sandbox is opened to measure it."""
        tasks = {}
        for i in range(256):
            task = self.sample_task(np.random.default_rng(i), "longest")
            tasks.setdefault(task.payload["question"], task)
        return max(len(self.prompt(task)) for task in tasks.values())

    def start(self, task: Task) -> Episode:
        if self.chat is not None:
            return ChatToolEpisode(self, task, self.chat)
        return ToolEpisode(self, task)

    def observation(self, output: str, max_chars: int | None = None, *,
                    note_error: Callable[[str], None] | None = None) -> list[int]:
        # Tag strings (any added token) in command output must not become control tokens.
        output, escaped = escape_added_tokens(self.tokenizer, output)
        if escaped and note_error is not None:
            note_error("special_tokens")
        output = output[: max_chars or self.max_observation_chars]
        return ([self.tokenizer.token_to_id(OUT_OPEN)] + self.encode(output)
                + [self.tokenizer.token_to_id(OUT_CLOSE)] + self.encode("\n"))

    def grade(self, episode: Episode, submitted: str) -> float:
        """``check``'s verdict as a reward; a file the harness refuses to read (a symlink, a FIFO,
        too large: ``envs.jail_files``) scores 0 and is counted under its reason."""
        try:
            return float(self.check(episode.task, submitted, episode.sandbox))
        except JailFileError as e:
            episode.note_error(e.reason)
            return 0.0

    def check(self, task: Task, submitted: str, sandbox: Sandbox) -> bool:
        check = task.payload["check"]
        if check["kind"] == "answer":
            return submitted.strip() == check["value"]
        # The model made the file: read it by descriptor, never following a link (envs.jail_files).
        try:
            return read_jail_text(sandbox.workdir, check["path"]).strip() == check["value"]
        except JailFileError as e:
            if e.reason == "file_missing":
                return False
            raise

    def demonstration(self, task: Task) -> tuple[list[int], list[int]]:
        """Call the solution command for real, then submit what the check expects."""
        if self.chat is not None:
            with self.start(task) as episode:
                return episode.demonstration()
        tid = self.tokenizer.token_to_id
        ids, mask = [], []

        def add(tokens: list[int], trained: bool) -> None:
            ids.extend(tokens)
            mask.extend([int(trained)] * len(tokens))

        with self.start(task) as episode:
            add(episode.prompt, False)
            add([tid(TOOL_OPEN)] + self.encode(task.payload["solution"]) + [tid(TOOL_CLOSE)], True)
            add(episode.run_tool(task.payload["solution"]), False)
            check = task.payload["check"]
            answer = check["value"] if check["kind"] == "answer" else "done"
            add([tid(SUBMIT_OPEN)] + self.encode(answer) + [tid(SUBMIT_CLOSE)], True)
        return ids, mask
