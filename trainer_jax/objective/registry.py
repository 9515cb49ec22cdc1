"""A tiny name -> function registry, one per family of loss variants.

Each variant is a small decorated function whose docstring states its math, so adding a variant
is adding one function::

    @IMPORTANCE_WEIGHTS.register("my_mode")
    def my_mode(r, c_min, c_max):
        '''w = ...'''
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class Registry(Generic[F]):
    """Maps variant names to functions for one family (``kind``) of loss components."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: register ``fn`` under ``name`` (names are unique within a registry)."""

        def deco(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return deco

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._entries)})"
