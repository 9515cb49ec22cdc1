"""Environments by name, by import path, or from installed packages.

A task-mix entry's ``env`` is one of:

- a built-in name (``arithmetic``, ``shell``, ``dataset``, ...: ``envs.base.ENVIRONMENTS``);
- an import path ``"my_package.envs:MyEnvironment"``: any importable subclass of
  ``envs.base.Environment`` (``module:Class``; nested attributes as ``module:Outer.Inner``);
- the name of an entry point in the group ``mixrl.envs`` that a package installs
  (``[project.entry-points."mixrl.envs"] my_env = "my_package.envs:MyEnvironment"``).

Options: a built-in environment's typed model (``envs.options``); an outside class may declare its
own pydantic model as ``Options`` (checked the same way), otherwise its constructor's keyword
parameters are the names accepted; every outside class also takes ``timeout_s``, mixrl's limit on
each of its calls on a sampler (``envs.isolated``), which the class never sees. Every problem is
one line naming it, raised when the config loads (``EnvLoadError``). An outside environment is
user code, trusted like a user reward function: it draws tasks in the trainer, and its episodes
run in worker processes of every sampler that leases its tasks (``envs.isolated``; docs: "Bring
your own environment").
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from tokenizers import Tokenizer

from envs.base import ENVIRONMENTS, Environment

ENTRY_POINT_GROUP = "mixrl.envs"
#: Environments shipped with mixrl that run as outside ones (worker processes on a sampler,
#: ``options.timeout_s``): they talk to other programs (``envs.openenv_env``: an OpenEnv server;
#: ``envs.verifiers_env``: a ``verifiers`` environment driving turns through a generate endpoint).
PACKAGED = {"openenv": "envs.openenv_env:OpenEnv", "verifiers": "envs.verifiers_env:VerifiersEnvironment"}
#: Seconds an outside environment's ``start`` or ``step`` may take (``options.timeout_s``).
DEFAULT_TIMEOUT_S = 30.0


class EnvLoadError(ValueError):
    """An environment cannot be found, imported, or built with the options given."""


def _entry_point(name: str):
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep
    return None


def _import(spec: str) -> Any:
    module_name, _, qualname = spec.partition(":")
    if not module_name or not qualname:
        raise EnvLoadError(f"environment {spec!r}: an import path is 'module:Class'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure of user code is one line
        raise EnvLoadError(f"environment {spec!r}: cannot import {module_name!r} "
                           f"({type(e).__name__}: {e})") from None
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EnvLoadError(f"environment {spec!r}: module {module_name!r} has no "
                               f"{qualname!r}") from None
    return obj


def resolve_env(spec: str) -> type[Environment]:
    """The environment class ``spec`` names (built-in, ``module:Class`` or entry point)."""
    if spec in ENVIRONMENTS:
        return ENVIRONMENTS[spec]
    if spec in PACKAGED:
        obj = _import(PACKAGED[spec])
    elif ":" in spec:
        obj = _import(spec)
    else:
        ep = _entry_point(spec)
        if ep is None:
            raise EnvLoadError(
                f"unknown environment {spec!r}: not built in "
                f"({', '.join(sorted([*ENVIRONMENTS, *PACKAGED]))}), "
                f"not an import path 'module:Class', and no installed package registers it in "
                f"the {ENTRY_POINT_GROUP!r} entry points")
        try:
            obj = ep.load()
        except Exception as e:  # noqa: BLE001
            raise EnvLoadError(f"environment {spec!r}: entry point {ep.value!r} fails to load "
                               f"({type(e).__name__}: {e})") from None
    if not (inspect.isclass(obj) and issubclass(obj, Environment)):
        raise EnvLoadError(f"environment {spec!r}: {obj!r} is not a subclass of "
                           "envs.base.Environment")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        raise EnvLoadError(f"environment {spec!r}: {obj.__name__} does not implement {missing}")
    return obj


def default_name(spec: str, cls: type[Environment] | None = None) -> str:
    """The metrics name of an entry without ``name:``: the built-in or entry point name, else the
    class name."""
    if ":" not in spec:
        return spec
    cls = cls or resolve_env(spec)
    return cls.__name__


def check_options(spec: str, cls: type[Environment], options: dict[str, Any]) -> None:
    """Refuse, in one line, options ``cls`` does not take (``EnvLoadError``)."""
    if spec in ENVIRONMENTS:
        from envs.options import check_env_options

        try:
            check_env_options(spec, options)
        except ValueError as e:
            raise EnvLoadError(f"environment {spec!r}: options: {e}") from None
        return
    timeout_s(spec, options)
    options = {k: v for k, v in options.items() if k != "timeout_s"}
    model = getattr(cls, "Options", None)
    if inspect.isclass(model) and issubclass(model, BaseModel):
        try:
            model.model_validate(options)
        except ValidationError as e:
            from envs.options import describe_errors

            raise EnvLoadError(f"environment {spec!r}: options: {describe_errors(e)}") from None
        return
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = [n for n, p in params.items() if n not in ("self", "tokenizer", "difficulty")
             and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise EnvLoadError(f"environment {spec!r}: unknown option(s) {', '.join(unknown)} "
                           f"(known: {', '.join(known) or 'none'})")


def timeout_s(spec: str, options: dict[str, Any]) -> float:
    """An outside environment's per-call limit, ``options.timeout_s`` (seconds; default
    ``DEFAULT_TIMEOUT_S``): mixrl's option, never passed to the class (``envs.isolated``)."""
    value = options.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600:
        raise EnvLoadError(f"environment {spec!r}: options: timeout_s must be a number of seconds "
                           f"in (0, 3600], got {value!r}")
    return float(value)


def has_demonstration(cls: type[Environment]) -> bool:
    """Whether ``cls`` writes demonstrations (what the supervised warm start needs)."""
    return cls.demonstration is not Environment.demonstration


def make_env(name: str, tokenizer: Tokenizer, **kwargs) -> Environment:
    """Build environment ``name``: a built-in name, ``module:Class`` or an entry point of the
    ``mixrl.envs`` group (``resolve_env``)."""
    cls: Callable[..., Environment] = resolve_env(name)
    if name not in ENVIRONMENTS:  # mixrl's limit per call on a sampler (envs.isolated), not the class's
        kwargs.pop("timeout_s", None)
    return cls(tokenizer, **kwargs)


__all__ = ["DEFAULT_TIMEOUT_S", "ENTRY_POINT_GROUP", "EnvLoadError", "check_options",
           "default_name", "has_demonstration", "make_env", "resolve_env", "timeout_s"]
