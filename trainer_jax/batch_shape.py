"""Does a step's batch fit the packer? The worst case of a config, checked before a run starts.

A step takes ``train.prompts_per_step`` prompt groups of ``tasks.group_size`` samples. The packer
(``trainer_jax.batching.pack``, called from ``loop.batches.BatchBuilder``) places them first-fit into
``train.rows`` rows of ``train.row_len`` tokens, with at most ``train.max_tokens`` policy tokens
per step (the length of the token batch the objective sees):

- a sample longer than ``row_len`` can never be placed: it is dropped when it arrives
  (``samples_too_long_total``);
- samples that find no room (rows full, or the step's policy tokens spent) are carried to the
  next step, at most one step's worth; the rest are dropped (``samples_dropped_total``).

With every sample at most ``L`` tokens long and at most ``p`` of them policy tokens, first-fit
places at least ``rows * (row_len // L)`` samples before it refuses one (a row it cannot use holds
more than ``row_len - L`` tokens, so at least ``row_len // L`` samples), and at least
``max_tokens // p`` before the token budget refuses one. Their minimum is what a step is
guaranteed to train; if it is less than ``prompts_per_step * group_size``, a step whose replies
run to their limit drops the rest, every step (the carry only moves the loss to the next step).
That is the check: a shape that would drop is a ``ConfigError`` naming the keys and numbers, or,
with ``train.allow_drop: true``, one warning line with the share a step drops in that worst case.

Lengths per task-mix entry:

- single-turn environments: ``prompt + tasks.sampling.max_new_tokens`` tokens, all of the new
  ones policy tokens (the service refuses longer replies);
- multi-turn environments (``shell``): the sampler ends an episode when it reaches
  ``prompt + train.episode_tokens`` tokens (spawned samplers get ``--episode-tokens`` from the
  config; external ones must pass the same), observations included, so a sample is at most that
  long with at most ``episode_tokens`` policy tokens. (``chain`` is one long single turn.)
- the prompt is the longest the entry can produce: exact for the character-level generators and
  the chat-math task (``longest_prompt()`` of the environment), measured over every row for a
  dataset (``envs.dataset.longest_prompt``, rendered through the chat template). At config load,
  before the tokenizer is read, a prompt the check cannot know yet counts as 0 tokens (a lower
  bound: a shape that fails then fails for sure); the run checks again with the tokenizer.

A mix is budgeted as if every sample were as long as its longest entry's (safe, and exact for a
mix of one). Entries whose samples exceed ``row_len`` drop their share outright.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from trainer_jax.config import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from trainer_jax.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Demand:
    """One task-mix entry's worst-case sample: ``tokens`` long, ``policy`` of them trained on."""

    env: str
    share: float  # the entry's share of the samples (its mix weight, normalised)
    tokens: int
    policy: int
    prompt_known: bool = True


@dataclasses.dataclass(frozen=True)
class Fit:
    """What a step produces against what the packer is guaranteed to place."""

    samples: int  # prompts_per_step x group_size
    capacity: int  # samples placed for sure, of those that fit a row
    too_long: tuple[str, ...]  # entries whose longest sample exceeds row_len
    drop_share: float  # the share of a step's samples dropped when every reply runs to its limit
    rows_capacity: int
    tokens_capacity: int
    longest: int  # longest sample that fits a row (0: none does)
    policy: int

    @property
    def fits(self) -> bool:
        return self.drop_share == 0.0


def fit(samples: int, demands: list[Demand], *, rows: int, row_len: int, max_tokens: int) -> Fit:
    """The worst case of one step: ``samples`` samples drawn by ``demands`` into ``rows x row_len``
    rows with ``max_tokens`` policy tokens (the module docstring derives the bounds)."""
    total = sum(d.share for d in demands) or 1.0
    long_ = [d for d in demands if d.tokens > row_len]
    placeable = [d for d in demands if d.tokens <= row_len]
    longest = max((d.tokens for d in placeable), default=0)
    policy = max((d.policy for d in placeable), default=0)
    rows_capacity = rows * (row_len // longest) if longest else 0
    tokens_capacity = max_tokens // policy if policy else 0
    capacity = min(rows_capacity, tokens_capacity)
    too_long_share = sum(d.share for d in long_) / total
    placed_share = 1.0 - too_long_share
    want = samples * placed_share  # the worst case: each entry produces its share
    dropped = too_long_share + (max(0.0, want - capacity) / samples if samples else 0.0)
    return Fit(samples=samples, capacity=capacity, too_long=tuple(d.env for d in long_),
               drop_share=min(1.0, dropped), rows_capacity=rows_capacity,
               tokens_capacity=tokens_capacity, longest=longest, policy=policy)


def demands(cfg: RunConfig, prompts: list[int | None] | None = None) -> list[Demand]:
    """The worst-case sample of each task-mix entry; ``prompts[i]``: entry i's longest prompt
    (None, or no list: not known, counted as 0)."""
    from envs import ENVIRONMENTS

    entries = cfg.tasks.mix_entries()
    prompts = list(prompts) if prompts is not None else [None] * len(entries)
    out = []
    for entry, prompt in zip(entries, prompts, strict=True):
        single = getattr(ENVIRONMENTS.get(entry.env), "single_turn", True)
        new = cfg.tasks.sampling.max_new_tokens if single else cfg.train.episode_tokens
        out.append(Demand(entry.env, entry.weight, (prompt or 0) + new, new, prompt is not None))
    return out


def check(cfg: RunConfig, prompts: list[int | None] | None = None) -> str | None:
    """None when a step always fits; a warning line when it may drop and ``train.allow_drop`` is
    set; else ``ConfigError`` with the keys, the numbers and shapes that would fit."""
    t, tasks = cfg.train, cfg.tasks
    wanted = demands(cfg, prompts)
    result = fit(t.prompts_per_step * tasks.group_size, wanted, rows=t.rows, row_len=t.row_len,
                 max_tokens=t.max_tokens)
    if result.fits:
        return None
    line = describe(cfg, wanted, result)
    if t.allow_drop:
        return f"train.allow_drop: {line}"
    raise ConfigError(f"{line}; or set train.allow_drop: true to run anyway")


def describe(cfg: RunConfig, wanted: list[Demand], result: Fit) -> str:
    """One line: what a step makes, what the packer places, what is lost, what would fit."""
    t, tasks = cfg.train, cfg.tasks
    longest = max(wanted, key=lambda d: d.tokens)
    unknown = ("" if all(d.prompt_known for d in wanted)
               else " (prompts not counted until the tokenizer loads)")
    made = (f"a step makes train.prompts_per_step {t.prompts_per_step} x tasks.group_size "
            f"{tasks.group_size} = {result.samples} samples of up to {longest.tokens} tokens "
            f"({longest.env}: prompt + {_new_key(cfg, longest)}){unknown}")
    if result.too_long:
        return (f"{made}: longer than train.row_len {t.row_len}, so every {'/'.join(result.too_long)} "
                f"sample that long is dropped (up to {result.drop_share:.0%} of a step's samples); "
                f"raise train.row_len to {longest.tokens} or more, or lower {_new_key(cfg, longest)}")
    per_row = t.row_len // result.longest
    need_rows = math.ceil(result.samples / per_row)
    need_tokens = result.samples * result.policy
    return (f"{made}; train.rows {t.rows} x train.row_len {t.row_len} place at least "
            f"{result.rows_capacity} of them ({per_row} a row) and train.max_tokens {t.max_tokens} "
            f"at least {result.tokens_capacity} ({result.policy} policy tokens each): up to "
            f"{result.drop_share:.0%} of a step's samples dropped when replies run to their limit. "
            f"Fits: train.rows {max(t.rows, need_rows)} or more (a multiple of the mesh's batch "
            f"shards) and train.max_tokens {max(t.max_tokens, need_tokens)}, or fewer prompts_per_step / "
            f"group_size / {_new_key(cfg, longest)}")


def _new_key(cfg: RunConfig, demand: Demand) -> str:
    from envs import ENVIRONMENTS

    single = getattr(ENVIRONMENTS.get(demand.env), "single_turn", True)
    return "tasks.sampling.max_new_tokens" if single else "train.episode_tokens"


# ---------------------------------------------------------------------------------------------
# Prompt lengths


def longest_prompts(cfg: RunConfig, tokenizer: Tokenizer, *, datasets: bool = True) -> list[int | None]:
    """Per task-mix entry, its longest prompt in ``tokenizer``'s tokens (None: not known).

    Builds each generator environment as the run will (so one it cannot serve with this
    tokenizer, e.g. ``arithmetic`` with a model's own tokenizer, is a ``ConfigError`` here, before
    any device, checkpoint or run directory is touched); a dataset is read and every row rendered
    (``datasets=False``: left unknown, for the check at config load).
    """
    from envs import make_env
    from envs.dataset import longest_prompt as dataset_prompt

    out: list[int | None] = []
    for entry in cfg.tasks.mix_entries():
        where = f"tasks{'.mix' if cfg.tasks.env == 'mix' else ''} ({entry.env})"
        try:
            if entry.env == "dataset":
                out.append(dataset_prompt(tokenizer, entry.options, cfg.tasks.chat_template_kwargs)
                           if datasets else None)
                continue
            env = make_env(entry.env, tokenizer, difficulty=entry.difficulty, **entry.options)
        except (ValueError, TypeError, OSError) as e:
            raise ConfigError(f"{where}: {' '.join(str(e).split())}") from None
        try:
            env.chat_template_kwargs = dict(cfg.tasks.chat_template_kwargs)
            measure = getattr(env, "longest_prompt", None)
            out.append(measure() if measure is not None else None)
        finally:
            env.close()
    return out


def check_config(cfg: RunConfig) -> None:
    """The check at config load (``mixrl-train``, before JAX is imported): exact for the
    character tokenizer's generator tasks, a lower bound where the prompt needs the model's
    tokenizer or a dataset file (``check_tasks`` finishes it). Raises ``ConfigError``."""
    if cfg.model.hf_dir:
        check(cfg)
        return
    from convert.tokenizer import char_tokenizer

    check(cfg, longest_prompts(cfg, char_tokenizer(), datasets=False))


def check_tasks(cfg: RunConfig, tokenizer: Tokenizer) -> str | None:
    """The check with the run's tokenizer: every entry buildable, every prompt measured (datasets
    included). Returns the ``allow_drop`` warning line, if any; raises ``ConfigError``."""
    return check(cfg, longest_prompts(cfg, tokenizer))


__all__ = ["Demand", "Fit", "check", "check_config", "check_tasks", "demands", "fit", "longest_prompts"]
