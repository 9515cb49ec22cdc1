"""One sampling step for a batch of rows: the token, and every record the trainer needs.

Per row, with logits z and temperature T (T = 0: greedy, treated as T = 1 with top-k = 1):

- q = softmax(z / T) (``logprob_full``, ``head_*`` = the top ``head_k`` of q);
- the kept set S: sort q descending (stable, so ties keep vocabulary order); keep rank r when
  ``r < top_k`` (if top-k is on) and the mass before it, ``sum_{r' < r} q``, is ``<= top_p``
  (SGLang's ``top_k_top_p`` rule, both on the full q) -- always a non-empty prefix;
- b = q / q(S) on S (``logprob``, ``support_*``), or b = q when nothing is truncated;
- the token: inverse CDF of b at the row's uniform u, over S in sorted order when truncating,
  else over the vocabulary in id order (cumulative sums in float64).

Uniforms come from a counter-based generator: ``u = splitmix64(seed, n) / 2^64`` for the n-th
token of a request, so a request's samples depend only on its seed and its logits -- never on
which other requests share the batch or which slot it landed in (continuous batching reorders
both freely).

The mismatch dial (``Recipe.logit_noise = sigma > 0``) perturbs z before all of the above:
z' = z + sigma * eps with eps ~ N(0, 1) per vocabulary entry, from the same kind of counter-based
stream keyed by (seed, token index, vocabulary id) with its own salt (``logit_noise``), so the
noise is reproducible, independent of the sampling uniforms and of batching. Every record is of
z', the distribution actually sampled from.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """The SplitMix64 finalizer (Steele, Lea & Flood 2014), on uint64 arrays (wrapping)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniforms(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """float64 in [0, 1): the ``counters``-th draw of the SplitMix64 stream of each seed.

    The stream of seed s is ``mix(mix(s) + (n + 1) * golden)``, n = 0, 1, ...; hashing the seed
    first decorrelates the streams of neighbouring seeds (request i uses seed + i).
    """
    with np.errstate(over="ignore"):
        s = _mix64(np.asarray(seeds, np.uint64))
        z = _mix64(s + (np.asarray(counters, np.uint64) + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


# Salts the noise stream so it never coincides with the uniforms' stream of the same seed.
_NOISE_SALT = np.uint64(0x6C6F676974204E53)


def logit_noise(seeds: np.ndarray, counters: np.ndarray, vocab: int) -> np.ndarray:
    """float32 ``[B, vocab]`` standard normals: entry (i, j) depends only on ``seeds[i]``,
    ``counters[i]`` (the token's index in its request) and j.

    Box-Muller on two SplitMix64 draws per entry (u1 in (0, 1], u2 in [0, 1)); costs O(B * vocab)
    integer work per step in numpy, which is why it is a control for experiments, not a default.
    """
    with np.errstate(over="ignore"):
        seeds = np.asarray(seeds, np.uint64) ^ _NOISE_SALT
        key = _mix64(_mix64(seeds) + (np.asarray(counters, np.uint64) + np.uint64(1)) * _GOLDEN)
        j = np.arange(vocab, dtype=np.uint64)[None, :] * np.uint64(2)
        z1 = _mix64(key[:, None] + (j + np.uint64(1)) * _GOLDEN)
        z2 = _mix64(key[:, None] + (j + np.uint64(2)) * _GOLDEN)
    u1 = ((z1 >> np.uint64(11)).astype(np.float64) + 1.0) * (1.0 / 2**53)
    u2 = (z2 >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).astype(np.float32)


def perturb_logits(logits: torch.Tensor, sigma: float, seeds: np.ndarray,
                   counters: np.ndarray) -> torch.Tensor:
    """``logits + sigma * logit_noise(...)`` (a new float32 tensor); ``logits`` as is when sigma is 0."""
    if sigma <= 0:
        return logits
    noise = torch.from_numpy(logit_noise(seeds, counters, logits.shape[1])).to(logits.device)
    return logits.float() + sigma * noise


@dataclasses.dataclass
class StepRecords:
    tokens: torch.Tensor            # [B] int64
    logprob: torch.Tensor           # [B] float32, log b(x)
    logprob_full: torch.Tensor      # [B] float32, log q(x)
    head_ids: torch.Tensor          # [B, H] int64
    head_logprobs: torch.Tensor     # [B, H] float32
    support_ids: torch.Tensor       # [B, S] int64, -1 padded (S = 0 when no row truncates)
    support_logprobs: torch.Tensor  # [B, S] float32, -inf padded
    support_len: torch.Tensor       # [B] int64, 0 for rows that do not truncate


def _pick(cdf: torch.Tensor, u: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Smallest index i with ``cdf[i] > u * total`` (so zero-probability entries are never hit)."""
    total = cdf.gather(1, last[:, None])
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    return torch.minimum(idx, last)


def _sample_untruncated(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                        head_k: int) -> tuple[torch.Tensor, ...]:
    """``sample_step`` for rows that all sample the full distribution at ``temperature > 0``:
    (tokens, log q(x), head log q, head ids). Same arithmetic, for ``torch.compile``."""
    logq = torch.log_softmax(logits.float() / temperature.float()[:, None], dim=-1)
    cdf = logq.double().exp().cumsum(-1)
    last = torch.full_like(u, logq.shape[1] - 1, dtype=torch.long)
    tokens = _pick(cdf, u, last)
    head_lp, head_ids = logq.topk(head_k, dim=-1, sorted=True)
    return tokens, logq.gather(1, tokens[:, None])[:, 0], head_lp, head_ids


_COMPILED: dict[str, object] = {}


def sample_untruncated_compiled(logits: torch.Tensor, temperature: torch.Tensor,
                                u: torch.Tensor, head_k: int) -> StepRecords:
    """The compiled ``_sample_untruncated`` as ``StepRecords`` (no support; ``head_k >= 1``)."""
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(_sample_untruncated, dynamic=False)
    return _records(logits, *_COMPILED["fn"](logits, temperature, u, min(head_k, logits.shape[1])))


def sample_untruncated(logits: torch.Tensor, temperature: torch.Tensor | None, u: torch.Tensor,
                       head_k: int) -> StepRecords:
    """``sample_step`` for rows that all sample the full distribution (``temperature > 0``, no
    top-p/top-k) with ``head_k >= 1``, eagerly: the same arithmetic in about half the ops, which
    is what a decode step of a small model spends its time on. ``temperature=None``: every row
    at temperature 1 (dividing by 1 changes no float, so it is skipped)."""
    vocab = logits.shape[1]
    z = logits.float()
    logq = torch.log_softmax(z if temperature is None else z / temperature.float()[:, None], -1)
    # exp and cumsum in place on the float64 copy: the same values, one [B, V] float64 buffer
    # instead of three (each as large as the logits twice over)
    cdf = logq.double().exp_().cumsum_(-1)
    # _pick with every row's last index vocab - 1: the total is the last column
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, _zero(total)))
    tokens = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=vocab - 1)
    head_lp, head_ids = logq.topk(min(head_k, vocab), dim=-1, sorted=True)
    return _records(logits, tokens, logq.gather(1, tokens[:, None])[:, 0], head_lp, head_ids)


_ZEROS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_EMPTY: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _zero(like: torch.Tensor) -> torch.Tensor:
    """A 0-d zero of ``like``'s dtype and device, made once (``nextafter``'s direction)."""
    key = (like.dtype, like.device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros((), dtype=like.dtype, device=like.device)
    return _ZEROS[key]


def _records(logits: torch.Tensor, tokens: torch.Tensor, lq: torch.Tensor,
             head_lp: torch.Tensor, head_ids: torch.Tensor) -> StepRecords:
    key = (logits.shape[0], logits.device)
    if key not in _EMPTY:  # no support records: the same (never written) tensors every step
        b, dev = key
        _EMPTY[key] = (torch.empty(b, 0, dtype=torch.long, device=dev),
                       torch.empty(b, 0, dtype=torch.float32, device=dev),
                       torch.zeros(b, dtype=torch.long, device=dev))
    return StepRecords(tokens, lq, lq, head_ids, head_lp, *_EMPTY[key])


def sample_step(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                top_k: torch.Tensor, head_k: int, u: torch.Tensor) -> StepRecords:
    """Sample one token per row of ``logits [B, V]`` (see the module docstring).

    ``temperature``/``top_p`` float ``[B]``, ``top_k`` int ``[B]`` (<= 0: off), ``u`` float64 ``[B]``.
    """
    b, vocab = logits.shape
    dev = logits.device
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    logq = torch.log_softmax(logits.float() / temp[:, None], dim=-1)
    k = torch.where(greedy, torch.ones_like(top_k), top_k)
    k = torch.where((k <= 0) | (k >= vocab), torch.zeros_like(k), k)  # 0: no top-k
    trunc = (top_p < 1) | (k > 0)

    tokens = torch.empty(b, dtype=torch.long, device=dev)
    logprob = torch.empty(b, dtype=torch.float32, device=dev)
    support_ids = torch.empty(b, 0, dtype=torch.long, device=dev)
    support_lp = torch.empty(b, 0, dtype=torch.float32, device=dev)
    support_len = torch.zeros(b, dtype=torch.long, device=dev)

    any_trunc = bool(trunc.any())
    # Index only when rows differ (the common all-full / all-truncated batches need no copy).
    full = (torch.arange(b, device=dev) if not any_trunc
            else torch.nonzero(~trunc)[:, 0])
    if full.numel():
        lq = logq if not any_trunc else logq[full]
        cdf = lq.double().exp().cumsum(-1)
        idx = _pick(cdf, u[full], torch.full_like(full, vocab - 1))
        tokens[full] = idx
        logprob[full] = lq.gather(1, idx[:, None])[:, 0]

    rows = torch.nonzero(trunc)[:, 0] if any_trunc else full[:0]
    if rows.numel():
        every = rows.numel() == b
        lq = logq if every else logq[rows]
        kr, pr = (k, top_p.double()) if every else (k[rows], top_p[rows].double())
        # Only a prefix can be kept: with top-k on every row, the top max(k) suffice.
        width = int(kr.max()) if bool((kr > 0).all()) else vocab
        if width < vocab:
            sl, order = lq.topk(width, dim=-1, sorted=True)
            # topk orders tied values arbitrarily (it kept ids 2, 3 of four equal logits at
            # top-k 2): on a tie inside the top width or at its edge, sort stably as the rule says
            if bool(((sl[:, 1:] == sl[:, :-1]).any()) or ((lq >= sl[:, -1:]).sum(-1) > width).any()):
                sl, order = (t[:, :width] for t in lq.sort(dim=-1, descending=True, stable=True))
        else:
            sl, order = lq.sort(dim=-1, descending=True, stable=True)
        p = sl.double().exp()
        before = p.cumsum(-1) - p
        rank = torch.arange(width, device=dev)
        keep = (before <= pr[:, None]) & ((kr[:, None] <= 0) | (rank[None] < kr[:, None]))
        keep[:, 0] = True
        n_keep = keep.sum(-1)
        log_mass = torch.logsumexp(sl.masked_fill(~keep, float("-inf")), dim=-1)
        logb = (sl - log_mass[:, None]).masked_fill(~keep, float("-inf"))
        cdf = (p * keep).cumsum(-1)
        j = _pick(cdf, u[rows], n_keep - 1)
        tokens[rows] = order.gather(1, j[:, None])[:, 0]
        logprob[rows] = logb.gather(1, j[:, None])[:, 0]
        width_used = int(n_keep.max())
        support_ids = torch.full((b, width_used), -1, dtype=torch.long, device=dev)
        support_lp = torch.full((b, width_used), float("-inf"), dtype=torch.float32, device=dev)
        support_ids[rows] = order[:, :width_used].masked_fill(~keep[:, :width_used], -1)
        support_lp[rows] = logb[:, :width_used]
        support_len[rows] = n_keep

    logprob_full = logq.gather(1, tokens[:, None])[:, 0]
    if head_k > 0:
        head_lp, head_ids = logq.topk(min(head_k, vocab), dim=-1, sorted=True)
    else:
        head_lp = torch.empty(b, 0, device=dev)
        head_ids = torch.empty(b, 0, dtype=torch.long, device=dev)
    return StepRecords(tokens, logprob, logprob_full, head_ids, head_lp, support_ids, support_lp,
                       support_len)
