"""Run configs: YAML files validated by pydantic models, with ``key.sub=value`` overrides.

One config system for every entry point. Unknown keys are errors (a typo must not silently fall
back to a default), and every error names the offending key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """The policy: an HF directory to start from, or a tiny random Qwen3 for local runs."""

    hf_dir: str | None = None
    vocab: Literal["char"] = "char"
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    head_dim: int = Field(16, gt=0)
    tie_word_embeddings: bool = True
    num_experts: int = Field(0, ge=0)
    num_experts_per_tok: int = Field(0, ge=0)
    moe_intermediate_size: int = Field(0, ge=0)
    seed: int = 0


class SamplerGroupConfig(_Strict):
    """One group of samplers sharing a precision setup."""

    name: str
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    attention: Literal["sdpa", "eager"] = "sdpa"


class RunSection(_Strict):
    name: str = "run"
    dir: str = "runs/run"
    seed: int = 0
    steps: int = Field(1, ge=0)


class MismatchProbeConfig(_Strict):
    """The sampler-vs-trainer mismatch probe: prompts sampled by each group, scored by the trainer."""

    prompts: int = Field(16, gt=0)
    prompt_len: int = Field(8, gt=0)
    max_new_tokens: int = Field(32, gt=0)
    temperature: float = Field(1.0, gt=0)


class RunConfig(_Strict):
    run: RunSection = RunSection()
    model: ModelConfig = ModelConfig()
    groups: list[SamplerGroupConfig] = Field(default_factory=lambda: [SamplerGroupConfig(name="bf16")])
    probe: MismatchProbeConfig = MismatchProbeConfig()

    @model_validator(mode="after")
    def _unique_group_names(self) -> RunConfig:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"sampler group names must be unique, got {names}")
        return self


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the key."""


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict; ``value`` is parsed as YAML (``3``, ``true``, ``[1]``)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not of the form key=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r} has an empty key part")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: value is not valid YAML ({e})") from None


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p} is not valid YAML ({e})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
    for override in overrides:
        apply_override(tree, override)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"invalid config{f' {path}' if path else ''}: {problems}") from None
