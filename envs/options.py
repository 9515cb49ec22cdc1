"""Typed options of each environment (``tasks.mix[].options``), checked when a config loads.

An environment's constructor takes its options as keyword arguments, so a misspelt name was a
``TypeError`` at the first episode and a wrong type or value (``max_turns: many``,
``families: [lokup]``) was kept silently until a sampler tripped on it. Each environment has a
pydantic model here: unknown names are refused (``extra="forbid"``), types are strict (``"3"`` is
not an integer, ``true`` is not a number), values are ranged or listed. ``check_env_options``
turns the first problems into one line naming ``options.<key>``. The models mirror the
constructors' keyword parameters (tests/envs/test_env_options.py holds them together).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MIB = 1024**2


class EnvOptions(BaseModel):
    """Options of an environment without any."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ArithmeticOptions(EnvOptions):
    pass


class ReverseOptions(EnvOptions):
    pass


class ChainOptions(EnvOptions):
    scoring: Literal["exact", "steps", "prefix"] = "exact"


class RewardPoolOptions(EnvOptions):
    """Options of an environment that scores in a reward worker pool (``envs.rewards``)."""

    reward_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    reward_workers: int = Field(2, ge=1, le=256)


class ChatMathOptions(RewardPoolOptions):
    system_prompt: str = "Solve the problem. Give the final answer as \\boxed{n}."


class ShellOptions(EnvOptions):
    # ``limits`` (a SandboxLimits) is a constructor argument for code, not a config option.
    max_turns: int = Field(4, ge=1, le=1000)
    max_observation_chars: int = Field(48, ge=1, le=1_000_000)
    allow_unisolated: bool = False
    families: list[Literal["lookup", "sum", "write"]] | None = Field(None, min_length=1)
    allow_unbounded_memory: bool = False


class RepoOptions(EnvOptions):
    """``env: repo`` (``envs.repo``): ``episode_tokens`` should equal ``train.episode_tokens`` so
    the environment, not the sampler's budget, ends (and grades) an episode that runs long."""

    max_turns: int = Field(12, ge=1, le=1000)
    episode_tokens: int = Field(4096, ge=1, le=1_000_000)
    reply_reserve: int = Field(64, ge=0, le=1_000_000)
    max_observation_chars: int = Field(3000, ge=1, le=1_000_000)
    allow_unisolated: bool = False
    allow_unbounded_memory: bool = False


class DatasetOptions(RewardPoolOptions):
    """``env: dataset`` (``envs.dataset``); ``max_row_bytes`` caps each JSONL line as it is
    read, ``skip_bad_rows`` skips (and counts) rows that fail instead of refusing the file."""

    path: str = Field(min_length=1)
    prompt_key: str = Field("prompt", min_length=1)
    answer_key: str | None = Field(None, min_length=1)
    system_prompt: str | None = None
    reward: str = "exact"
    shuffle_seed: int = Field(0, ge=0)
    eval_path: str | None = Field(None, min_length=1)
    allow_unbounded_memory: bool = False
    max_row_bytes: int = Field(MIB, ge=64, le=1024 * MIB)
    skip_bad_rows: bool = False

    @field_validator("reward")
    @classmethod
    def _reward_form(cls, v: str) -> str:
        from envs.rewards import check_reward_spec

        return check_reward_spec(v)


OPTIONS: dict[str, type[EnvOptions]] = {
    "arithmetic": ArithmeticOptions, "reverse": ReverseOptions, "chain": ChainOptions,
    "chat_math": ChatMathOptions, "shell": ShellOptions, "dataset": DatasetOptions, "repo": RepoOptions,
}


def describe_errors(e: ValidationError, prefix: str = "options") -> str:
    """A pydantic error list as one line: ``options.max_turns: Input should be a valid integer``."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown option"
        elif err["type"] in ("bool_type", "bool_parsing"):
            msg = "must be true or false"
        elif "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], dict):
            msg += f", got {err['input']!r}"[:120]
        parts.append(f"{prefix}.{loc}: {msg}" if loc else f"{prefix}: {msg}")
    return " ".join("; ".join(parts).split())


def check_env_options(env: str, options: dict[str, Any]) -> EnvOptions:
    """``options`` as ``env``'s typed model, or a ``ValueError`` of one line naming each bad key
    (with the known names when one is unknown). An environment without a model takes anything."""
    model = OPTIONS.get(env)
    if model is None:
        return EnvOptions()
    try:
        return model.model_validate(options)
    except ValidationError as e:
        line = describe_errors(e)
        if any(err["type"] == "extra_forbidden" for err in e.errors()):
            line += f" (known: {', '.join(model.model_fields) or 'none'})"
        raise ValueError(line) from None


__all__ = ["OPTIONS", "ChainOptions", "ChatMathOptions", "DatasetOptions", "EnvOptions", "RepoOptions",
           "ShellOptions",
           "check_env_options", "describe_errors"]
