"""The implementation names, defined once for the kernel API, configs and benchmarks.

``ImplName`` is the single place a name is spelled: ``IMPL_NAMES`` is read back from it, so a
pydantic field typed ``ImplName`` and a check ``impl in IMPL_NAMES`` can never disagree. Adding
an implementation is one line here plus its entry in ``api.IMPLS`` (checked at import time).
"""

from __future__ import annotations

from typing import Literal, get_args

ImplName = Literal["reference", "xla", "pallas"]

IMPL_NAMES: tuple[str, ...] = get_args(ImplName)
