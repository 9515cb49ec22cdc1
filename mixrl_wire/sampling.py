"""Sampling parameters: the one Python definition, beside the wire message it converts to.

The trainer's config (``tasks.sampling``), the rollout service's tasks, the episode driver and the
sampler engine all use this class; ``to_pb`` / ``from_pb`` convert to and from
``mixrl.v1.SamplingParams``. Torch- and JAX-free, like the rest of ``mixrl_wire``.
"""

from __future__ import annotations

import dataclasses
import math

from mixrl_wire.v1 import rollout_pb2 as pb

# Unknown keys in a config's ``tasks.sampling`` are errors, as everywhere in the config schema
# (pydantic reads this attribute on plain dataclasses).
_PYDANTIC_CONFIG = {"extra": "forbid"}


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

    __pydantic_config__ = _PYDANTIC_CONFIG

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

    def to_pb(self) -> pb.SamplingParams:
        """The wire message (``seed`` None travels as 0)."""
        return pb.SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                 head_k=self.head_k, max_new_tokens=self.max_new_tokens,
                                 stop_token_ids=list(self.stop_token_ids), seed=self.seed or 0)

    @classmethod
    def from_pb(cls, msg: pb.SamplingParams, *, seed: int | None = None) -> SamplingParams:
        """From the wire message; ``seed`` replaces the message's (sample i of a task: seed + i).

        An unset ``top_p`` (0 on the wire) means no nucleus truncation.
        """
        return cls(temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k,
                   head_k=msg.head_k, max_new_tokens=msg.max_new_tokens,
                   stop_token_ids=tuple(msg.stop_token_ids),
                   seed=(msg.seed if seed is None else seed) % 2**63)
