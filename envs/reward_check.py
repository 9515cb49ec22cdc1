"""Is a reward function there? Checked when a config loads, without importing or running it.

A misspelt ``package.module:function`` used to surface when the environment started its reward
workers (after the run directory was set aside and the model built), or as zeros all run. The
trainer must not import user code (it may import torch, or do anything at import), so this looks
the module up on the path the reward workers get (``envs.rewards``: the project root, then the
trainer's ``sys.path``) with the import system's path finder, which executes nothing, and reads
its source: the function must be bound at the module's top level (a ``def``, an import, an
assignment), and not to a literal. What cannot be told without running code (a module found by
another finder, a module-level ``__getattr__``, ``import *``) passes here; the workers' own
import check (``RewardPool.check``) still runs when the environment starts.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from envs.rewards import BUILTINS, check_reward_spec

_ROOT = str(Path(__file__).resolve().parent.parent)
_LITERALS = (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set, ast.JoinedStr, ast.ListComp,
             ast.DictComp, ast.SetComp)


def _search_path() -> list[str]:
    return list(dict.fromkeys([_ROOT, *(p or os.getcwd() for p in sys.path)]))


def _find(module: str):
    """``(spec, None)``: the module found on the workers' path without executing any package;
    ``(None, name)``: ``name`` (the module or a package above it) is not there; ``(..., None)``:
    only another finder knows it (an editable install's hook), so it cannot be followed here."""
    parts = module.split(".")
    spec = importlib.machinery.PathFinder.find_spec(parts[0], _search_path())
    if spec is None:
        top = parts[0]
        if top in sys.builtin_module_names or importlib.util.find_spec(top) is not None:
            return ..., None
        return None, top
    for i in range(1, len(parts)):
        name = ".".join(parts[: i + 1])
        if not spec.submodule_search_locations:  # a module, not a package: no submodules
            return None, name
        spec = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
        if spec is None:
            return None, name
    return spec, None


def _top_level_names(tree: ast.Module) -> tuple[dict[str, ast.AST | None], bool]:
    """Names bound at the module's top level (with the value assigned, when a plain assignment)
    and whether the module can bind names this cannot see (``import *``, ``__getattr__``)."""
    names: dict[str, ast.AST | None] = {}
    opaque = False

    def visit(body) -> None:
        nonlocal opaque
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names[node.name] = None
                opaque |= node.name == "__getattr__"
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name):
                            names[n.id] = node.value if isinstance(target, ast.Name) else None
            elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
                names[node.target.id] = getattr(node, "value", None)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*":
                        opaque = True
                    else:
                        names[alias.asname or alias.name.split(".")[0]] = None
            elif isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
                # Conditional definitions (try/except ImportError, if TYPE_CHECKING) count too.
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return names, opaque


def check_reward_target(spec: object) -> str:
    """``spec`` if it is a built-in reward or a ``module:function`` whose module is on the
    workers' path and binds ``function`` at top level to something that may be callable; else a
    ``ValueError`` of one line. Imports and runs nothing."""
    spec = check_reward_spec(spec)
    if spec in BUILTINS:
        return spec
    module, _, attr = spec.partition(":")
    found, missing = _find(module)
    if found is ...:
        return spec
    if found is None:
        raise ValueError(f"reward {spec!r} cannot be loaded: ModuleNotFoundError: No module named "
                         f"{missing!r} (searched the project root and the trainer's sys.path)")
    origin = found.origin
    if not origin or not origin.endswith(".py") or not os.path.isfile(origin):
        return spec  # a package without __init__.py, an extension module: the workers check it
    try:
        tree = ast.parse(Path(origin).read_bytes(), filename=origin)
    except SyntaxError as e:
        raise ValueError(f"reward {spec!r} cannot be loaded: SyntaxError in {origin} line {e.lineno}: "
                         f"{e.msg}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"reward {spec!r}: cannot read {origin}: {e}") from None
    names, opaque = _top_level_names(tree)
    if attr not in names:
        if opaque:
            return spec
        defined = sorted(n for n, v in names.items() if v is None and not n.startswith("_"))
        raise ValueError(f"reward {spec!r}: {module} ({origin}) defines no {attr!r}; it defines: "
                         f"{', '.join(defined[:20]) or 'nothing'}")
    if isinstance(names[attr], _LITERALS):
        raise ValueError(f"reward {spec!r}: {module}.{attr} is not callable (bound to a "
                         f"{type(names[attr]).__name__.lower()} literal in {origin})")
    return spec


__all__ = ["check_reward_target"]
