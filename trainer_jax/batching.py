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
    """One trajectory with its per-token behaviour record (docs/design.md section 3).

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

    @classmethod
    def from_record(cls, record, prompt_ids, group_index: int) -> Sample:
        """A validated wire trajectory (``TrajectoryRecord``: tokens after the prompt) as a
        ``Sample`` of the whole sequence, prompt first."""
        p = len(record.logprobs)
        prompt = np.asarray(prompt_ids, np.int32)
        empty = record.support_indptr is None
        return cls(
            token_ids=np.concatenate([prompt, record.token_ids]),
            loss_mask=np.concatenate([np.zeros(len(prompt), record.loss_mask.dtype), record.loss_mask]),
            logprobs=record.logprobs, head_ids=record.head_ids, head_logprobs=record.head_logprobs,
            support_indptr=np.zeros(p + 1, np.int32) if empty else record.support_indptr,
            support_ids=np.zeros(0, np.int32) if empty else record.support_ids,
            support_logprobs=np.zeros(0, np.float32) if empty else record.support_logprobs,
            versions=record.versions, reward=float(record.reward or 0.0), group=group_index,
            task_id=record.task_id, sample_index=record.sample_index)

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


class RowPacker:
    """First-fit placement of sequences into ``rows x row_len`` with segment ids and positions."""

    def __init__(self, rows: int, row_len: int):
        self.row_len = row_len
        self.ids = np.zeros((rows, row_len), np.int32)
        self.seg = np.zeros((rows, row_len), np.int32)
        self.pos = np.zeros((rows, row_len), np.int32)
        self.fill = np.zeros(rows, np.int64)
        self.next_seg = np.ones(rows, np.int32)

    def place(self, tokens: np.ndarray) -> tuple[int, int] | None:
        """Put ``tokens`` in the first row with room; ``(row, start)`` or None if none has."""
        length = len(tokens)
        if length > self.row_len:
            raise ValueError(f"a sequence of {length} tokens is longer than row_len={self.row_len}")
        fits = np.nonzero(self.fill + length <= self.row_len)[0]
        if len(fits) == 0:
            return None
        r = int(fits[0])
        start = int(self.fill[r])
        self.ids[r, start:start + length] = tokens
        self.seg[r, start:start + length] = self.next_seg[r]
        self.pos[r, start:start + length] = np.arange(length)
        self.next_seg[r] += 1
        self.fill[r] += length
        return r, start

    def inputs(self, token_rows: np.ndarray, token_cols: np.ndarray) -> PackedInputs:
        return PackedInputs(input_ids=self.ids, segment_ids=self.seg, positions=self.pos,
                            token_rows=token_rows, token_cols=token_cols)


def pack_sequences(sequences: list[tuple[list[int], list[int]]], *, rows: int, row_len: int,
                   max_tokens: int) -> tuple[PackedInputs, np.ndarray, np.ndarray, int]:
    """Pack ``(token_ids, loss_mask)`` pairs for supervised training.

    Returns inputs, targets ``[max_tokens]``, a target mask and how many sequences fit.
    """
    packer = RowPacker(rows, row_len)
    token_rows = np.zeros(max_tokens, np.int32)
    token_cols = np.zeros(max_tokens, np.int32)
    targets = np.zeros(max_tokens, np.int32)
    mask = np.zeros(max_tokens, np.float32)
    n, count = 0, 0
    for ids, loss_mask in sequences:
        ids, loss_mask = np.asarray(ids, np.int32), np.asarray(loss_mask)
        cols = np.nonzero(loss_mask[1:])[0] + 1
        if n + len(cols) > max_tokens:
            break
        placed = packer.place(ids)
        if placed is None:
            break
        r, start = placed
        token_rows[n:n + len(cols)] = r
        token_cols[n:n + len(cols)] = start + cols - 1
        targets[n:n + len(cols)] = ids[cols]
        mask[n:n + len(cols)] = 1
        n += len(cols)
        count += 1
    return packer.inputs(token_rows, token_cols), targets, mask, count


def non_finite_advantages(advantages: np.ndarray) -> np.ndarray:
    """Which prompt groups of ``advantages`` [P, G] (float32, as trained) hold a value that is not
    finite, as a bool [P]. Their tokens reach the objective, which drops them (``dropped``): in
    float32 a group of rewards near 3e38 overflows its mean or std to inf, and its advantages
    come out NaN although every reward is finite (``trainer_jax.diagnostics.AdvantageAlarm``)."""
    a = np.asarray(advantages)
    if a.ndim != 2:
        raise ValueError(f"advantages must be [P, G], got shape {a.shape}")
    return ~np.isfinite(a).all(axis=1)


def pack(samples: list[Sample], advantages: np.ndarray, *, rows: int, row_len: int, max_tokens: int,
         head_k: int, support_k: int, temperature: float, trainer_version: int,
         max_staleness: int | None = None) -> tuple[PackedInputs, TokenBatch, list[int]]:
    """Pack ``samples`` (advantage per sample) into ``rows x row_len`` and a ``max_tokens`` batch.

    Returns the inputs, the token batch and the indices of the samples that fit; the rest (a row
    budget or token budget overflow) are left for the next batch. Tokens older than
    ``max_staleness`` versions are masked out of the loss. A sequence longer than ``row_len`` is
    an error (the config must give rows room for the longest trajectory).
    """
    packer = RowPacker(rows, row_len)
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
        p = s.num_policy_tokens
        if n + p > max_tokens:
            continue
        placed = packer.place(s.token_ids)
        if placed is None:
            continue
        r, start = placed
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
    inputs = packer.inputs(fields.pop("token_rows"), fields.pop("token_cols"))
    batch = TokenBatch.create(temperature=temperature, trainer_version=trainer_version, **fields)
    return inputs, batch, taken
