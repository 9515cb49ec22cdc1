"""Hand-built, internally consistent trajectory data for wire tests (no model needed).

Each token draws random logits, samples from the (possibly truncated) distribution and records
exactly what docs/design.md section 3 asks for, so a valid fake passes validation and any single
corruption of it must not.
"""

from __future__ import annotations

import numpy as np

from mixrl_wire import pb
from mixrl_wire.encoder import build_trajectory


def fake_records(n: int, vocab: int, head_k: int, rng: np.random.Generator, *, top_p: float = 1.0,
                 top_k: int = 0, temperature: float = 1.0, version: int = 0) -> dict:
    """Per-token behaviour arrays for ``n`` policy tokens."""
    logits = rng.normal(size=(n, vocab)).astype(np.float64) * 2.0 / temperature
    logq = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    order = np.argsort(-logq, axis=1, kind="stable")
    head_ids = order[:, :head_k].astype(np.int32)
    head_lp = np.take_along_axis(logq, head_ids, axis=1).astype(np.float32)
    truncation = top_p < 1.0 or top_k > 0
    tokens, lp, sup_ids, sup_lps = [], [], [], []
    for t in range(n):
        if truncation:
            sorted_p = np.exp(logq[t, order[t]])
            keep = int(np.searchsorted(np.cumsum(sorted_p), top_p) + 1) if top_p < 1 else vocab
            if top_k > 0:
                keep = min(keep, top_k)
            ids = order[t, :keep]
            logb = logq[t, ids] - np.logaddexp.reduce(logq[t, ids])
            j = rng.choice(keep, p=np.exp(logb) / np.exp(logb).sum())
            tokens.append(int(ids[j]))
            lp.append(float(logb[j]))
            sup_ids.append(ids.astype(np.int32))
            sup_lps.append(logb.astype(np.float32))
        else:
            p = np.exp(logq[t])
            tok = int(rng.choice(vocab, p=p / p.sum()))
            tokens.append(tok)
            lp.append(float(logq[t, tok]))
    out = dict(token_ids=np.array(tokens, np.int32), logprobs=np.minimum(np.array(lp, np.float32), 0),
               logprobs_full=np.minimum(logq[np.arange(n), tokens].astype(np.float32), 0),
               versions=np.full(n, version, np.int32), head_ids=head_ids, head_logprobs=head_lp)
    if truncation:
        out["support_ids"] = sup_ids
        out["support_logprobs"] = sup_lps
    return out


def fake_trajectory(task: pb.Task, sample_index: int, vocab: int, rng: np.random.Generator, *,
                    n_tokens: int | None = None, version: int = 0, env_tokens: int = 0) -> pb.Trajectory:
    """A valid trajectory for ``task``; ``env_tokens`` appends environment tokens (loss mask 0)."""
    s = task.sampling
    n = n_tokens or max(1, min(s.max_new_tokens, 8))
    rec = fake_records(n, vocab, s.head_k, rng, top_p=s.top_p, top_k=s.top_k,
                       temperature=s.temperature or 1.0, version=version)
    tokens = rec.pop("token_ids")
    mask = np.ones(n, np.uint8)
    if env_tokens:
        tokens = np.concatenate([tokens, rng.integers(0, vocab, env_tokens).astype(np.int32)])
        mask = np.concatenate([mask, np.zeros(env_tokens, np.uint8)])
    return build_trajectory(task, sample_index, token_ids=tokens, loss_mask=mask, finish_reason="length",
                            generate_ms=1.0, **rec)
