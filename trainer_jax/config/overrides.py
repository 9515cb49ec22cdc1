"""``key=value`` overrides of a config tree, with list entries chosen by name.

A key is a dotted path of sections (``train.rows``); ``[NAME]`` after a list's key picks the
entry whose ``name:`` is NAME (``groups[bf16].capacity``, ``groups[h100-fp8].spawn``): names may
hold any character but brackets, dots and dashes included, and a name that is not there is one
line listing the names that are. The value is a YAML document (``3``, ``true``, ``[1]``), loaded
with the limits of ``trainer_jax.config.yaml_safe``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from trainer_jax.config.base import ConfigError
from trainer_jax.config.yaml_safe import MAX_OVERRIDE_BYTES, YamlError, load_yaml, short

# A section name (no dot, bracket or "="), or an entry's name in brackets.
_PART = re.compile(r"([^.\[\]=]+)|\[([^\[\]]+)\]")


class ByName(str):
    """A key part that picks a list entry by its ``name:``."""


def parse_key(key: str, override: str) -> list[str]:
    """``groups[bf16].capacity`` -> ``["groups", ByName("bf16"), "capacity"]``."""
    parts: list[str] = []
    pos, after_dot = 0, False
    while True:
        m = _PART.match(key, pos)
        if m is None or (m.group(2) is not None and (after_dot or not parts)):
            if pos == len(key) or key[pos] == ".":
                raise ConfigError(f"override {short(override)} has an empty key part")
            raise ConfigError(f"override {short(override)}: key {short(key)} is not of the form a.b.c "
                              "or a[NAME].c")
        parts.append(m.group(1) if m.group(1) is not None else ByName(m.group(2)))
        pos, after_dot = m.end(), False
        if pos == len(key):
            return parts
        if key[pos] == ".":
            pos, after_dot = pos + 1, True
        elif key[pos] != "[":
            raise ConfigError(f"override {short(override)}: key {short(key)} is not of the form a.b.c "
                              "or a[NAME].c")


def _cut(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _entry(items: Any, name: str, where: str, override: str) -> int:
    """The index of the entry of the list ``items`` named ``name``."""
    if not isinstance(items, list):
        raise ConfigError(f"override {short(override)}: {where!r} is not a list of named entries, so "
                          f"[{_cut(name)}] cannot pick one")
    names = [e["name"] for e in items if isinstance(e, dict) and e.get("name") is not None]
    for i, e in enumerate(items):
        if isinstance(e, dict) and e.get("name") == name:
            return i
    known = ", ".join(n if isinstance(n, str) else short(n, 40) for n in names) or "none"
    what = "group" if where == "groups" else f"entry of {where}"
    raise ConfigError(f"override {short(override)}: no {what} named {short(name, 60)} (known: "
                      f"{known if len(known) <= 300 else known[:297] + '...'})")


def apply_override(tree: dict[str, Any], override: str,
                   defaults: Mapping[str, list[dict[str, Any]]] | None = None) -> None:
    """Apply ``a.b.c=value`` or ``a[NAME].c=value`` to the nested dict ``tree``. ``defaults``:
    the entries a top-level list has when the tree does not set it (``groups``' default), so
    ``groups[bf16].x=...`` works on a config that keeps the default groups."""
    if len(override) > MAX_OVERRIDE_BYTES:
        raise ConfigError(f"override {short(override)} is {len(override):,} characters, over the limit "
                          f"of {MAX_OVERRIDE_BYTES:,} for one override (put it in the config file)")
    if "=" not in override:
        raise ConfigError(f"override {short(override)} is not of the form key=value")
    key, raw = override.split("=", 1)
    parts = parse_key(key.strip(), override)
    try:
        value = load_yaml(raw, f"override {short(override)}")
    except YamlError as e:
        raise ConfigError(str(e)) from None
    node: Any = tree
    where: list[str] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        nxt = None if last else parts[i + 1]
        path = ".".join(where) or "the config"
        if isinstance(part, ByName):
            index = _entry(node, part, path, override)
            where[-1] += f"[{part}]"
            if last:
                node[index] = value
                return
            node = node[index]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"override {short(override)}: {path!r} is not a section")
        where.append(part)
        if last:
            node[part] = value
            return
        if part not in node or node[part] is None:
            if isinstance(nxt, ByName):
                if i == 0 and defaults and part in defaults:
                    node[part] = copy.deepcopy(list(defaults[part]))
                else:
                    raise ConfigError(f"override {short(override)}: the config has no list "
                                      f"{'.'.join(where)} to pick [{_cut(nxt)}] from")
            else:
                node[part] = {}
        node = node[part]
    raise AssertionError("unreachable: the last part returns")


__all__ = ["ByName", "apply_override", "parse_key"]
