"""Tasks from a dataset file: ``env: dataset`` in the task mix.

Options: ``path`` (a local ``.jsonl``, or a ``.parquet`` read with pyarrow: no cache is written),
``prompt_key`` (a string becomes one user message; a list of ``{role, content}``
messages is used as is), ``answer_key`` (optional), ``system_prompt`` (optional), ``reward`` (a
built-in name or ``package.module:function``, see ``envs.rewards``), ``reward_timeout_s``,
``reward_workers``, ``shuffle_seed``, ``eval_path`` (a held-out file for the periodic
evaluation), ``max_row_bytes`` (default 1 MiB: a longer JSONL line is a bad row, found after
reading that much of it) and ``skip_bad_rows``. Typed and checked at config load
(``envs.options.DatasetOptions``), and so is every row of the files: a line that is not JSON, not
an object, lacks the prompt or answer column or holds a prompt that is neither text nor messages
is one error naming the file and line, or, with ``skip_bad_rows: true``, left out and counted
(``env/dataset/skipped_rows`` in the metrics). A bad row never becomes a task.

The environment's ``k``-th task is row ``perm_e[k % N]`` with ``e = k // N`` and ``perm_e`` a
permutation seeded by ``(shuffle_seed, e)``: every epoch is reshuffled deterministically and a
resumed run (whose task cursor gives ``k``) continues mid-epoch. The task payload the sampler
gets is the row index only (the prompt ids travel with the task); the trainer keeps the dataset
and scores the decoded reply with the reward in its worker pool.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from convert.tokenizer import special_token_ids
from envs.base import Environment, Episode, StepResult, Task, register_env
from envs.chat import Chat
from envs.options import MIB, DatasetOptions, check_env_options
from envs.reward_check import check_reward_target
from envs.rewards import RewardPool, RewardResult
from envs.sandbox import ALLOW_UNBOUNDED_ENV, SandboxUnavailable, check_jail_support

SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
OPTIONS = tuple(DatasetOptions.model_fields)
_CHUNK = 64 * 1024  # how much of a JSONL file is read at a time


def check_options(options: dict[str, Any]) -> DatasetOptions:
    """One error line for options that cannot work (config load time): each option's name and
    type (``envs.options.DatasetOptions``), the files, and every row of them (``load_rows``:
    streamed, each line capped, the columns present), so a bad row is found before anything
    starts. The rows stay cached for the environment that follows."""
    if not options.get("path"):
        raise ValueError("dataset: options.path is required (a .jsonl or .parquet file)")
    try:
        opts = check_env_options("dataset", options)
    except ValueError as e:
        raise ValueError(f"dataset: {e}") from None
    for key in ("path", "eval_path"):
        if getattr(opts, key) is None:
            continue
        path = Path(getattr(opts, key))
        if path.suffix not in SUFFIXES:
            raise ValueError(f"dataset: options.{key} {str(path)!r} is not .jsonl or .parquet")
        if not path.is_file():  # a FIFO would block the reader, /dev/zero never ends
            what = "is not a regular file" if path.exists() else "does not exist"
            raise ValueError(f"dataset: options.{key} {str(path)!r} {what}")
    if opts.reward == "code":  # its sandbox needs a cgroup, or the explicit opt-out
        try:
            check_jail_support(opts.allow_unbounded_memory)
        except SandboxUnavailable as e:
            raise ValueError(f"dataset: reward code: {e}") from None
    check_reward_target(opts.reward)
    for path in filter(None, (opts.path, opts.eval_path)):
        rows_of(path, opts)
    return opts


class BadRow(ValueError):
    """A dataset row that cannot be a task; the message names the file and the line or row."""


class Rows:
    """A dataset's good rows: ``rows[i]`` a row (dict), ``rows[key]`` a column, ``len(rows)``;
    ``skipped`` bad rows were left out (``options.skip_bad_rows``)."""

    def __init__(self, path: str, source, columns: list[str], index: list[int] | None = None,
                 skipped: int = 0):
        self.path, self._source, self.column_names = path, source, columns
        self._index, self.skipped = index, skipped

    def __len__(self) -> int:
        return len(self._index) if self._index is not None else len(self._source)

    def __getitem__(self, key):
        if isinstance(key, str):
            return [self[i][key] for i in range(len(self))]
        return self._source[self._index[key] if self._index is not None else key]


def rows_of(path: str, opts: DatasetOptions) -> Rows:
    """``load_rows`` of ``path`` with the options' columns, cap and skipping."""
    return load_rows(str(path), prompt_key=opts.prompt_key, answer_key=opts.answer_key,
                     max_row_bytes=opts.max_row_bytes, skip_bad_rows=opts.skip_bad_rows)


def load_rows(path: str, *, prompt_key: str = "prompt", answer_key: str | None = None,
              max_row_bytes: int = MIB, skip_bad_rows: bool = False) -> Rows:
    """The file's rows, each checked: a JSONL file is streamed, never holding more than
    ``max_row_bytes`` of a line (a 100 MiB line is refused after reading 1 MiB of it, not parsed);
    a row that is not a JSON object, lacks ``prompt_key`` / ``answer_key`` or whose prompt is
    neither text nor messages is a ``BadRow`` naming the file and line, or, with
    ``skip_bad_rows``, left out and counted (``Rows.skipped``). Cached per file version."""
    st = os.stat(path)
    return _load_rows(path, st.st_mtime_ns, st.st_size, prompt_key, answer_key, max_row_bytes,
                      skip_bad_rows)


@functools.lru_cache(maxsize=16)
def _load_rows(path: str, _mtime: int, _size: int, prompt_key: str, answer_key: str | None,
               max_row_bytes: int, skip_bad_rows: bool) -> Rows:
    skipped = 0
    if path.endswith(".parquet"):
        table = _ParquetRows(path)
        columns = list(table.column_names)
        missing = [k for k in (prompt_key, answer_key) if k is not None and k not in columns]
        if missing:  # a parquet file's columns are the same for every row
            raise BadRow(f"dataset {path}: no column {missing[0]!r}; columns: {columns}")
        good = []
        for i, prompt in enumerate(table.column(prompt_key)):
            problem = _prompt_problem(prompt, prompt_key)
            if problem is None:
                good.append(i)
            elif skip_bad_rows:
                skipped += 1
            else:
                raise BadRow(f"dataset {path} row {i + 1}: {problem}")
        rows = Rows(path, table, columns, None if skipped == 0 else good, skipped)
    else:
        items: list[dict] = []
        columns: dict[str, None] = {}
        for line_no, row, problem in _jsonl(path, max_row_bytes):
            if problem is None:
                problem = _row_problem(row, prompt_key, answer_key)
            if problem is not None:
                if not skip_bad_rows:
                    raise BadRow(f"dataset {path} line {line_no}: {problem} (options.skip_bad_rows: "
                                 "true skips such rows)")
                skipped += 1
                continue
            items.append(row)
            columns.update(dict.fromkeys(row))
        rows = Rows(path, items, list(columns), None, skipped)
    if len(rows) == 0:
        raise BadRow(f"dataset {path} has no rows" + (f" ({skipped} bad rows skipped)" if skipped else ""))
    return rows


class _ParquetRows:
    """A parquet file's rows, read with pyarrow: ``rows[i]`` a row as a dict. Nothing is written
    anywhere (the Hugging Face ``datasets`` reader cached an Arrow copy of every file under
    ``~/.cache/huggingface``); a file pyarrow cannot read is a ``BadRow`` of one line."""

    def __init__(self, path: str):
        import pyarrow as pa
        import pyarrow.parquet as pq

        if os.path.getsize(path) == 0:
            raise BadRow(f"dataset {path}: an empty file (0 bytes), not a parquet file")
        try:
            self._table = pq.read_table(path, memory_map=True)
        except (pa.ArrowException, OSError) as e:  # not parquet, truncated, a corrupt footer
            raise BadRow(f"dataset {path}: not a readable parquet file "
                          f"({' '.join(str(e).split())[:200]})") from None
        self.column_names = self._table.column_names

    def __len__(self) -> int:
        return self._table.num_rows

    def __getitem__(self, i: int) -> dict:
        return self._table.slice(i, 1).to_pylist()[0]

    def column(self, key: str) -> list:
        return self._table.column(key).to_pylist()


def _capped_lines(f, cap: int):
    """Each line of the binary file ``f`` without its ending, as a bytearray reused for the next
    line (parse it before asking for the next), or None for a line over ``cap`` bytes. Reads
    ``_CHUNK`` bytes at a time and keeps at most ``cap + 1`` bytes of a line: memory follows the
    cap, never the longest line (``readline`` would hold up to twice its limit)."""
    buf, over = bytearray(), False
    while True:
        chunk = f.read(_CHUNK)
        view, start = memoryview(chunk), 0
        while True:
            nl = chunk.find(b"\n", start) if chunk else -1
            end = len(chunk) if nl < 0 else nl
            if not over:
                if len(buf) + end - start > cap + 1:  # + 1: a "\r" before the "\n"
                    over = True
                    buf = bytearray()
                else:
                    buf += view[start:end]
            if nl < 0:
                break
            if not over and buf.endswith(b"\r"):
                del buf[-1]
            yield None if over or len(buf) > cap else buf
            buf, over, start = bytearray(), False, nl + 1
        view.release()
        if not chunk:
            if over or buf:  # a last line without "\n"
                yield None if over or len(buf.rstrip(b"\r")) > cap else buf
            return


def _jsonl(path: str, cap: int):
    """``(line number, object or None, problem or None)`` per non-blank line of ``path``, each
    line read with the cap (``_capped_lines``)."""
    with open(path, "rb") as f:
        for line_no, body in enumerate(_capped_lines(f, cap), 1):
            if body is None:
                yield line_no, None, f"longer than options.max_row_bytes ({cap} bytes)"
                continue
            if not body.strip():
                continue
            try:
                row = json.loads(body)
            except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
                yield line_no, None, f"invalid JSON ({' '.join(str(e).split())[:120]})"
                continue
            yield line_no, row, None


def _row_problem(row, prompt_key: str, answer_key: str | None) -> str | None:
    if not isinstance(row, dict):
        return f"not a JSON object (a {type(row).__name__})"
    for key in (prompt_key, answer_key):
        if key is not None and key not in row:
            return f"no column {key!r} (options.{'prompt_key' if key == prompt_key else 'answer_key'}); " \
                   f"columns: {list(row)[:20]}"
    return _prompt_problem(row[prompt_key], prompt_key)


def _prompt_problem(prompt, key: str) -> str | None:
    if isinstance(prompt, str):
        return None if prompt else f"column {key!r} is empty"
    if (isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt)):
        return None
    return f"column {key!r} is neither text nor a list of {{role, content}} messages"


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
    opts = check_options(options)
    path, key = opts.path, opts.prompt_key
    rows = rows_of(path, opts)
    chat = Chat.from_tokenizer(tokenizer)
    if chat is None and special_token_ids(tokenizer).get("eos") is None:
        raise ValueError("dataset: the tokenizer has neither a chat template nor an <eos> token")
    system = opts.system_prompt
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
                 eval_path: str | None = None, allow_unbounded_memory: bool = False,
                 max_row_bytes: int = MIB, skip_bad_rows: bool = False):
        super().__init__(tokenizer, difficulty)
        if path is None:
            # What a sampler sees building the environment by name: it generates from the task's
            # prompt ids instead (the trainer scores the reply).
            raise ValueError("dataset tasks are built and scored on the trainer (the rows stay there); "
                             "samplers generate from the task's prompt ids")
        options = dict(path=path, prompt_key=prompt_key, answer_key=answer_key, system_prompt=system_prompt,
                       reward=reward, reward_timeout_s=reward_timeout_s, reward_workers=reward_workers,
                       shuffle_seed=shuffle_seed, eval_path=eval_path,
                       allow_unbounded_memory=allow_unbounded_memory, max_row_bytes=max_row_bytes,
                       skip_bad_rows=skip_bad_rows)
        self.options = check_options({k: v for k, v in options.items() if v is not None})
        self.path, self.eval_path = str(path), eval_path
        self.prompt_key, self.answer_key, self.system_prompt = prompt_key, answer_key, system_prompt
        self.shuffle_seed = shuffle_seed
        self.rows = rows_of(self.path, self.options)
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
                              rows=rows_of(self.eval_path, self.options), _perms={})
        return other

    def load_metrics(self) -> dict[str, float]:
        """What loading the rows counted: ``skipped_rows`` (``options.skip_bad_rows``), reported
        as ``env/dataset/skipped_rows`` with every step's metrics (nothing when none was)."""
        return {"skipped_rows": float(self.rows.skipped)} if self.rows.skipped else {}

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
        options = self.options.model_dump(exclude_none=True)  # the same rows (cap, skipping, columns)
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
