"""Pack sampled trajectories into fixed-shape rows for the learner.

Sequences share rows (first-fit by length), separated by segment ids, instead of one padded row
each. The learner runs the model on the rows and gathers the hidden state *before* each policy
token (the one that predicts it); the objective sees only those N policy tokens, as a
``TokenBatch``. Shapes are fixed per config (rows x row_len, a token bucket) so one compiled step
serves every batch.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from trainer_jax.objective import TokenBatch


@dataclasses.dataclass
class Sample:
    """One trajectory with its per-token behaviour record (DESIGN.md section 3).

    ``token_ids``/``loss_mask`` cover the whole sequence (prompt, policy and environment tokens);
    the per-policy-token arrays have one row per ``loss_mask == 1`` position, in order. The
    support set is CSR: token i's kept ids are ``support_ids[support_indptr[i]:support_indptr[i+1]]``
    (an empty range: truncation was off).
    """

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    head_ids: np.ndarray
    head_logprobs: np.ndarray
    support_indptr: np.ndarray
    support_ids: np.ndarray
    support_logprobs: np.ndarray
    versions: np.ndarray
    reward: float = 0.0
    group: int = 0
    task_id: int = 0
    sample_index: int = 0

    def __post_init__(self):
        p = int(np.sum(self.loss_mask))
        if self.loss_mask[:1].any():
            raise ValueError("the first token cannot be a policy token (nothing precedes it)")
        for name in ("logprobs", "versions"):
            if len(getattr(self, name)) != p:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {p} policy tokens")
        if self.head_ids.shape[0] != p or self.head_logprobs.shape != self.head_ids.shape:
            raise ValueError("head_ids / head_logprobs must be [policy tokens, K]")
        if len(self.support_indptr) != p + 1:
            raise ValueError("support_indptr must have policy tokens + 1 entries")

    @property
    def num_policy_tokens(self) -> int:
        return len(self.logprobs)


@dataclasses.dataclass(frozen=True)
class PackedInputs:
    """Model inputs ``[R, L]`` and where the N policy tokens' predicting states are."""

    input_ids: jax.Array
    segment_ids: jax.Array
    positions: jax.Array
    token_rows: jax.Array  # [N] row of the state that predicts policy token n
    token_cols: jax.Array  # [N] column of that state (the token's own column - 1)


jax.tree_util.register_dataclass(
    PackedInputs, data_fields=["input_ids", "segment_ids", "positions", "token_rows", "token_cols"],
    meta_fields=[])


def pack(samples: list[Sample], advantages: np.ndarray, *, rows: int, row_len: int, max_tokens: int,
         head_k: int, support_k: int, temperature: float, trainer_version: int,
         max_staleness: int | None = None) -> tuple[PackedInputs, TokenBatch, list[int]]:
    """Pack ``samples`` (advantage per sample) into ``rows x row_len`` and a ``max_tokens`` batch.

    Returns the inputs, the token batch and the indices of the samples that fit; the rest (a row
    budget or token budget overflow) are left for the next batch. Tokens older than
    ``max_staleness`` versions are masked out of the loss. A sequence longer than ``row_len`` is
    an error (the config must give rows room for the longest trajectory).
    """
    ids = np.zeros((rows, row_len), np.int32)
    seg = np.zeros((rows, row_len), np.int32)
    pos = np.zeros((rows, row_len), np.int32)
    fill = np.zeros(rows, np.int64)
    next_seg = np.ones(rows, np.int32)
    n = 0
    fields = {
        "token_rows": np.zeros(max_tokens, np.int32), "token_cols": np.zeros(max_tokens, np.int32),
        "token_ids": np.zeros(max_tokens, np.int32), "behavior_logprob": np.zeros(max_tokens, np.float32),
        "head_ids": np.full((max_tokens, head_k), -1, np.int32),
        "head_logprobs": np.full((max_tokens, head_k), -np.inf, np.float32),
        "support_ids": np.full((max_tokens, support_k), -1, np.int32),
        "support_logprobs": np.full((max_tokens, support_k), -np.inf, np.float32),
        "advantages": np.zeros(max_tokens, np.float32), "loss_mask": np.zeros(max_tokens, np.float32),
        "seq_ids": np.zeros(max_tokens, np.int32), "group_ids": np.zeros(max_tokens, np.int32),
        "versions": np.zeros(max_tokens, np.int32),
    }
    taken: list[int] = []
    for i, s in enumerate(samples):
        length, p = len(s.token_ids), s.num_policy_tokens
        if length > row_len:
            raise ValueError(f"sample {i} has {length} tokens, more than row_len={row_len}")
        if n + p > max_tokens:
            continue
        fits = np.nonzero(fill + length <= row_len)[0]
        if len(fits) == 0:
            continue
        r = int(fits[0])
        start = int(fill[r])
        ids[r, start:start + length] = s.token_ids
        seg[r, start:start + length] = next_seg[r]
        pos[r, start:start + length] = np.arange(length)
        next_seg[r] += 1
        fill[r] += length
        cols = start + np.nonzero(s.loss_mask)[0]
        sl = slice(n, n + p)
        fields["token_rows"][sl] = r
        fields["token_cols"][sl] = cols - 1
        fields["token_ids"][sl] = s.token_ids[cols - start]
        fields["behavior_logprob"][sl] = s.logprobs
        k = min(head_k, s.head_ids.shape[1])
        fields["head_ids"][sl, :k] = s.head_ids[:, :k]
        fields["head_logprobs"][sl, :k] = s.head_logprobs[:, :k]
        for j in range(p):
            lo, hi = int(s.support_indptr[j]), int(s.support_indptr[j + 1])
            if hi - lo > support_k:
                raise ValueError(f"sample {i} token {j}: support of {hi - lo} ids exceeds "
                                 f"support_k={support_k}")
            fields["support_ids"][n + j, : hi - lo] = s.support_ids[lo:hi]
            fields["support_logprobs"][n + j, : hi - lo] = s.support_logprobs[lo:hi]
        fields["advantages"][sl] = advantages[i]
        fresh = np.ones(p, bool) if max_staleness is None else (trainer_version - s.versions) <= max_staleness
        fields["loss_mask"][sl] = fresh
        fields["seq_ids"][sl] = len(taken)
        fields["group_ids"][sl] = s.group
        fields["versions"][sl] = s.versions
        n += p
        taken.append(i)
    inputs = PackedInputs(input_ids=ids, segment_ids=seg, positions=pos,
                          token_rows=fields.pop("token_rows"), token_cols=fields.pop("token_cols"))
    batch = TokenBatch.create(temperature=temperature, trainer_version=trainer_version, **fields)
    return inputs, batch, taken
