"""The base of every config section: frozen, and unknown keys are errors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from trainer_jax.config.yaml_safe import short


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the key."""


class Strict(BaseModel):
    """A config section: a typo must not silently fall back to a default, so extra keys fail."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def one_of(value: str, known, what: str) -> str:
    """``value`` if it is in ``known`` (any container of names), else a ValueError listing them."""
    if value not in known:
        raise ValueError(f"unknown {what} {short(value)}; known: {', '.join(known)}")
    return value


def check_registry(kind: str, implemented, names) -> None:
    """Raise if a runtime registry implements other names than the schema accepts: the schema
    keeps its variant names in light modules (no JAX, no runtime imports) and each registry calls
    this at import, so the two cannot drift apart."""
    if set(implemented) != set(names):
        raise RuntimeError(f"{kind}: the registry implements {sorted(implemented)}, the config schema "
                           f"accepts {sorted(names)}")
