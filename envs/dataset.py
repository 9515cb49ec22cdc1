"""Tasks from a dataset file: ``env: dataset`` in the task mix.

Options: ``path`` (a local ``.jsonl`` or ``.parquet``, read with the Hugging Face ``datasets``
library), ``prompt_key`` (a string becomes one user message; a list of ``{role, content}``
messages is used as is), ``answer_key`` (optional), ``system_prompt`` (optional), ``reward`` (a
built-in name or ``package.module:function``, see ``envs.rewards``), ``reward_timeout_s``,
``reward_workers``, ``shuffle_seed`` and ``eval_path`` (a held-out file for the periodic
evaluation).

The environment's ``k``-th task is row ``perm_e[k % N]`` with ``e = k // N`` and ``perm_e`` a
permutation seeded by ``(shuffle_seed, e)``: every epoch is reshuffled deterministically and a
resumed run (whose task cursor gives ``k``) continues mid-epoch. The task payload the sampler
gets is the row index only (the prompt ids travel with the task); the trainer keeps the dataset
and scores the decoded reply with the reward in its worker pool.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np

from convert.tokenizer import special_token_ids
from envs.base import Environment, Episode, StepResult, Task, register_env
from envs.chat import Chat
from envs.rewards import RewardPool, RewardResult, check_reward_spec
from envs.sandbox import ALLOW_UNBOUNDED_ENV, SandboxUnavailable, check_jail_support

SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
OPTIONS = ("path", "prompt_key", "answer_key", "system_prompt", "reward", "reward_timeout_s",
           "reward_workers", "shuffle_seed", "eval_path", "allow_unbounded_memory")


def check_options(options: dict[str, Any]) -> None:
    """One error line for options that cannot work, before anything is loaded (config load time)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"dataset: unknown options {unknown}; known: {list(OPTIONS)}")
    if not options.get("path"):
        raise ValueError("dataset: options.path is required (a .jsonl or .parquet file)")
    for key in ("path", "eval_path"):
        if options.get(key) is None:
            continue
        path = Path(str(options[key]))
        if path.suffix not in SUFFIXES:
            raise ValueError(f"dataset: options.{key} {str(path)!r} is not .jsonl or .parquet")
        if not path.is_file():
            raise ValueError(f"dataset: options.{key} {str(path)!r} does not exist")
    if not isinstance(options.get("prompt_key", "prompt"), str):
        raise ValueError("dataset: options.prompt_key must be a column name")
    check_reward_spec(options.get("reward", "exact"))
    if not isinstance(options.get("allow_unbounded_memory", False), bool):
        raise ValueError("dataset: options.allow_unbounded_memory must be true or false, "
                         f"got {options['allow_unbounded_memory']!r}")
    if options.get("reward") == "code":  # its sandbox needs a cgroup, or the explicit opt-out
        try:
            check_jail_support(options.get("allow_unbounded_memory") is True)
        except SandboxUnavailable as e:
            raise ValueError(f"dataset: reward code: {e}") from None
    timeout = options.get("reward_timeout_s", 10.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ValueError(f"dataset: options.reward_timeout_s must be a number > 0, got {timeout!r}")
    for key, low in (("reward_workers", 1), ("shuffle_seed", 0)):
        value = options.get(key, low)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"dataset: options.{key} must be an integer >= {low}, got {value!r}")


@functools.cache
def load_rows(path: str):
    """The file as a ``datasets.Dataset`` (memory-mapped arrow; rows by index)."""
    import datasets

    datasets.disable_progress_bars()
    if path.endswith(".parquet"):
        return datasets.Dataset.from_parquet(path)
    return datasets.Dataset.from_json(path)


def prompt_messages(prompt, system_prompt: str | None = None, *, where: str = "dataset") -> list[dict]:
    """A row's prompt as chat messages: text becomes one user turn, a list of ``{role, content}``
    messages is used as is; ``system_prompt`` goes first unless the row has its own."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError(f"{where}: the prompt is neither text nor a list of {{role, content}} messages")
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(chat: Chat | None, messages: list[dict], chat_template_kwargs: dict | None = None) -> str:
    """The text the model continues: the chat template's rendering with the generation prompt, or
    (no template: the character tokenizer of the local runs) the turns' text, one per line."""
    if chat is not None:
        return chat.render(messages, add_generation_prompt=True, **(chat_template_kwargs or {}))
    return "".join(m["content"] + "\n" for m in messages)


def longest_prompt(tokenizer, options: dict[str, Any], chat_template_kwargs: dict | None = None) -> int:
    """The most tokens a prompt of the training file (``options.path``) takes, every row rendered
    as the episodes render it (the chat template, the system prompt): what the batch-shape check
    (``trainer_jax.batch_shape``) budgets for. One pass over the prompt column; the rows stay
    loaded (``load_rows`` is cached) for the environment that follows."""
    check_options(options)
    path, key = str(options["path"]), options.get("prompt_key", "prompt")
    rows = load_rows(path)
    if key not in rows.column_names:
        raise ValueError(f"dataset {path}: no column {key!r}; columns: {rows.column_names}")
    if len(rows) == 0:
        raise ValueError(f"dataset {path} has no rows")
    chat = Chat.from_tokenizer(tokenizer)
    if chat is None and special_token_ids(tokenizer).get("eos") is None:
        raise ValueError("dataset: the tokenizer has neither a chat template nor an <eos> token")
    system = options.get("system_prompt")
    texts = [render_prompt(chat, prompt_messages(p, system, where=f"dataset {path}"), chat_template_kwargs)
             for p in rows[key]]
    if chat is not None:
        return max(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False))
    return 1 + max(len(e.ids) for e in tokenizer.encode_batch(texts))  # <bos> first


class ReplyEpisode(Episode):
    """One reply ending at a stop token; the reward is the trainer's (``DatasetTasks.score``)."""

    def __init__(self, prompt: list[int], stops: tuple[int, ...]):
        self.prompt, self.stop_token_ids = prompt, stops

    def step(self, generated: list[int]) -> StepResult:
        ended = bool(generated) and generated[-1] in self.stop_token_ids
        if not (generated[:-1] if ended else generated):
            return StepResult([], 0.0, True, "empty_reply")
        return StepResult([], 0.0, True, "answered" if ended else "length")


@register_env
class DatasetTasks(Environment):
    name = "dataset"
    single_turn = True

    def __init__(self, tokenizer, difficulty: int = 1, *, path: str | None = None, prompt_key: str = "prompt",
                 answer_key: str | None = None, system_prompt: str | None = None, reward: str = "exact",
                 reward_timeout_s: float = 10.0, reward_workers: int = 2, shuffle_seed: int = 0,
                 eval_path: str | None = None, allow_unbounded_memory: bool = False):
        super().__init__(tokenizer, difficulty)
        if path is None:
            # What a sampler sees building the environment by name: it generates from the task's
            # prompt ids instead (the trainer scores the reply).
            raise ValueError("dataset tasks are built and scored on the trainer (the rows stay there); "
                             "samplers generate from the task's prompt ids")
        options = {k: v for k, v in dict(path=path, eval_path=eval_path, reward=reward,
                                           reward_timeout_s=reward_timeout_s,
                                           allow_unbounded_memory=allow_unbounded_memory).items()
                   if v is not None}
        check_options(options)
        self.path, self.eval_path = str(path), eval_path
        self.prompt_key, self.answer_key, self.system_prompt = prompt_key, answer_key, system_prompt
        self.shuffle_seed = shuffle_seed
        self.rows = load_rows(self.path)
        missing = [k for k in (prompt_key, answer_key) if k is not None and k not in self.rows.column_names]
        if missing:
            raise ValueError(f"dataset {self.path}: no column {missing[0]!r}; "
                             f"columns: {self.rows.column_names}")
        if len(self.rows) == 0:
            raise ValueError(f"dataset {self.path} has no rows")
        if allow_unbounded_memory:  # the reward workers' sandboxes read it from their environment
            os.environ[ALLOW_UNBOUNDED_ENV] = "1"
        self.reward = RewardPool(reward, workers=reward_workers, timeout_s=reward_timeout_s)
        try:
            self.reward.check()  # a misspelt module or function: one line now, not zeros all run
        except ValueError:
            self.reward.close()
            raise
        self.chat = Chat.from_tokenizer(tokenizer)
        if self.chat is None and self.eos is None:
            raise ValueError("dataset: the tokenizer has neither a chat template nor an <eos> token")
        self._perms: dict[int, np.ndarray] = {}

    def for_evaluation(self) -> DatasetTasks:
        """The same environment over ``eval_path`` (itself when there is none)."""
        if self.eval_path is None:
            return self
        other = object.__new__(DatasetTasks)
        other.__dict__.update(self.__dict__, path=self.eval_path, eval_path=None,
                              rows=load_rows(self.eval_path), _perms={})
        return other

    def row_index(self, draw: int) -> int:
        n = len(self.rows)
        epoch, k = divmod(draw, n)
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.shuffle_seed, epoch]).permutation(n)}
        return int(self._perms[epoch][k])

    def sample_task(self, rng: np.random.Generator, task_id: str) -> Task:
        return self.sample_task_at(rng, task_id, int(rng.integers(len(self.rows))))

    def sample_task_at(self, rng: np.random.Generator, task_id: str, draw: int) -> Task:
        return Task(task_id, self.name, {"row": self.row_index(draw)})

    def messages(self, row: dict) -> list[dict]:
        return prompt_messages(row[self.prompt_key], self.system_prompt,
                               where=f"dataset {self.path}: {self.prompt_key!r}")

    def prompt_text(self, row: dict) -> str:
        return render_prompt(self.chat, self.messages(row), self.chat_template_kwargs)

    def longest_prompt(self) -> int:
        """The longest prompt of the training rows in tokens (``longest_prompt``)."""
        options = {"path": self.path, "prompt_key": self.prompt_key, "system_prompt": self.system_prompt}
        return longest_prompt(self.tokenizer, options, self.chat_template_kwargs)

    def start(self, task: Task) -> Episode:
        row = self.rows[int(task.payload["row"])]
        text = self.prompt_text(row)
        if self.chat is not None:
            return ReplyEpisode(self.chat.encode(text), self.chat.stop_ids)
        return ReplyEpisode([self.bos] + self.encode(text), (self.eos,))

    def score(self, task: Task, generated: list[int]) -> RewardResult:
        row = self.rows[int(task.payload["row"])]
        stops = self.chat.stop_ids if self.chat is not None else (self.eos,)
        body = generated[:-1] if generated and generated[-1] in stops else generated
        answer = row.get(self.answer_key) if self.answer_key else None
        return self.reward.score(completion=self.tokenizer.decode(body, skip_special_tokens=False),
                                 answer=answer, prompt=self.prompt_text(row), task=row)

    def demonstration(self, task: Task) -> tuple[list[int], list[int]]:
        raise NotImplementedError("dataset tasks have no demonstrations (set sft.steps: 0)")

    def close(self) -> None:
        self.reward.close()
