"""Request parameters and per-token behaviour records (``../shared/DESIGN.md`` section 3)."""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (or every request of a ``generate`` call).

    - ``temperature``: logits are divided by it; ``0`` means greedy (the argmax of the
      temperature-1 distribution, recorded as a one-token support with logprob 0).
    - ``top_p`` in (0, 1]: keep the most probable tokens while the probability mass *before*
      each one is at most ``top_p`` (SGLang's rule; always at least one token). 1 = off.
    - ``top_k``: keep the ``top_k`` most probable tokens; ``0`` or ``-1`` = off. With both,
      the kept set is the intersection (both measured on the full post-temperature distribution).
    - ``head_k``: how many of the most probable tokens of the full post-temperature distribution
      each token records (``head_ids`` / ``head_logprobs``); 0 records none.
    - ``max_new_tokens``: generation stops after this many tokens (finish reason ``length``).
    - ``stop_token_ids``: generation stops after emitting one of these (kept in the output,
      finish reason ``stop``).
    - ``seed``: the request's random stream; ``None`` draws a fresh one. With one
      ``SamplingParams`` for a whole ``generate`` call, request ``i`` uses ``seed + i``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    head_k: int = 20
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive count, got {self.top_k}")
        if self.head_k < 0:
            raise ValueError(f"head_k must be >= 0, got {self.head_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    def truncates(self, vocab_size: int) -> bool:
        """Whether sampling keeps only part of the vocabulary (so a support is recorded)."""
        return self.temperature == 0 or self.top_p < 1 or 0 < self.top_k < vocab_size


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
    - ``finish_reason``: ``"stop"`` or ``"length"``.
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
