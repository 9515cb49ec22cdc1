"""TokenBatch: the per-policy-token data the objective needs, as a JAX pytree."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array


@struct.dataclass
class TokenBatch:
    """Flat batch of N policy tokens (docs/design.md section 3 behaviour record).

    token_ids [N] int: sampled token x_t.
    behavior_logprob [N] f32: log b_t(x_t), after temperature and truncation/renormalisation.
    head_ids [N, K] int / head_logprobs [N, K] f32: top-K of q_t (padded -1 / -inf).
    support_ids [N, S] int / support_logprobs [N, S] f32: kept top-p set with renormalised log b
        (padded -1 / -inf; a row of padding means truncation was off for that token).
    advantages [N] f32, loss_mask [N] (0/1), seq_ids [N] int (batch-local, in [0, N)).
    temperature: sampling temperature tau (a static Python float: one compiled loss per tau).
    group_ids [N] int (optional): sampler group, for per-group metrics.
    versions [N] int (optional) with trainer_version (optional scalar): staleness metric.
    """

    token_ids: Array
    behavior_logprob: Array
    head_ids: Array
    head_logprobs: Array
    support_ids: Array
    support_logprobs: Array
    advantages: Array
    loss_mask: Array
    seq_ids: Array
    temperature: float = struct.field(pytree_node=False, default=1.0)
    group_ids: Array | None = None
    versions: Array | None = None
    trainer_version: Array | None = None

    @classmethod
    def create(cls, *, temperature: Any = 1.0, **fields: Any) -> TokenBatch:
        """Build from array-likes; coerces dtypes and makes ``temperature`` a Python float."""
        ints = {"token_ids", "head_ids", "support_ids", "seq_ids", "group_ids", "versions"}
        out: dict[str, Any] = {}
        for name, value in fields.items():
            if value is None:
                out[name] = None
            elif name in ints:
                out[name] = jnp.asarray(value, jnp.int32)
            else:
                out[name] = jnp.asarray(value, jnp.float32)
        tau = float(temperature)
        if not tau > 0.0:
            raise ValueError(f"temperature must be > 0, got {tau}")
        return cls(temperature=tau, **out)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def check_shapes(self) -> None:
        """Raise ValueError with the offending field when shapes are inconsistent."""
        n = self.token_ids.shape[0]

        def want(name: str, shape: tuple[int, ...]) -> None:
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"TokenBatch.{name} has shape {got}, expected {shape}")

        for name in ("token_ids", "behavior_logprob", "advantages", "loss_mask", "seq_ids"):
            want(name, (n,))
        if self.head_ids.ndim != 2:
            raise ValueError(f"TokenBatch.head_ids must be [N, K], got {self.head_ids.shape}")
        if self.support_ids.ndim != 2:
            raise ValueError(f"TokenBatch.support_ids must be [N, S], got {self.support_ids.shape}")
        want("head_ids", (n, self.head_ids.shape[1]))
        want("head_logprobs", (n, self.head_ids.shape[1]))
        want("support_ids", (n, self.support_ids.shape[1]))
        want("support_logprobs", (n, self.support_ids.shape[1]))
        for name in ("group_ids", "versions"):
            if getattr(self, name) is not None:
                want(name, (n,))
        if not self.temperature > 0:
            raise ValueError(f"TokenBatch.temperature must be > 0, got {self.temperature}")
