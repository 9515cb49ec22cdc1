"""Per-token behaviour records of a request (``docs/design.md`` section 3).

``SamplingParams`` is defined once, beside the wire message it converts to, in
``mixrl_wire.sampling``; it is re-exported here because the engine's API takes it.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence

from mixrl_wire.sampling import SamplingParams


@dataclasses.dataclass
class Completion:
    """One generated sequence with its per-token records, all aligned with ``token_ids``.

    - ``logprobs[t]``: log b_t(x_t), the distribution actually sampled from (after temperature
      and truncation, renormalised over the kept set).
    - ``logprobs_full[t]``: log q_t(x_t), after temperature, before truncation.
    - ``head_ids[t]`` / ``head_logprobs[t]``: the ``head_k`` most probable tokens of q_t and their
      log q_t, most probable first.
    - ``support_ids[t]`` / ``support_logprobs[t]``: the kept set S_t (most probable first) with
      log b_t; ``None`` for the whole completion when the request does not truncate.
    - ``versions[t]``: the weights version whose forward produced the logits of token t.
    - ``finish_reason``: ``"stop"``, ``"length"``, or ``"stopped"`` (``generate(should_stop=)`` ended it).
    """

    index: int
    prompt_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    logprobs_full: list[float] = dataclasses.field(default_factory=list)
    head_ids: list[list[int]] = dataclasses.field(default_factory=list)
    head_logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    support_ids: list[list[int]] | None = None
    support_logprobs: list[list[float]] | None = None
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str = "length"
    seed: int = 0


def per_request(n: int, params: SamplingParams | Sequence[SamplingParams]
                ) -> tuple[list[SamplingParams], list[int]]:
    """One ``SamplingParams`` and one seed per request of a ``generate`` call.

    A single ``SamplingParams`` applies to all ``n`` requests, request ``i`` seeded ``seed + i``
    (a fresh random base when ``seed`` is None); a sequence must hold exactly ``n``.
    """
    if isinstance(params, SamplingParams):
        base = params.seed if params.seed is not None else secrets.randbits(62)
        return [params] * n, [(base + i) % 2**63 for i in range(n)]
    plist = list(params)
    if len(plist) != n:
        raise ValueError(f"{n} prompts but {len(plist)} SamplingParams")
    return plist, [p.seed if p.seed is not None else secrets.randbits(62) for p in plist]
