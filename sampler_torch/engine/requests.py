"""The engine's per-request bookkeeping: the requests of a ``generate`` call, what the call did
(``GenerateStats``), and the one place a step's records leave the device (``record_step``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from sampler_torch.engine.params import Completion, SamplingParams, per_request


@dataclasses.dataclass
class Request:
    """One prompt of a ``generate`` call and where its records go."""

    index: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    out: Completion
    truncates: bool
    slot: int = -1


@dataclasses.dataclass
class GenerateStats:
    """What the last ``generate`` did, step by step (for tests, benchmarks and logs)."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    #: (step, request index, slot) for every admission
    admissions: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    #: (step, request index) for every retirement
    retirements: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    #: (step, version) for every weight swap applied during the call
    swaps: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    #: seconds each of those swaps stopped generation (the in-place writes)
    pauses_s: list[float] = dataclasses.field(default_factory=list)
    #: whether decode steps ran through the compiled static-shape step (``Engine(compile=...)``)
    compiled_decode: bool = False


def make_requests(prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                  vocab: int) -> list[Request]:
    """The requests of a ``generate`` call, each prompt checked against the vocabulary."""
    plist, seeds = per_request(len(prompts), params)
    reqs = []
    for i, (prompt, p, seed) in enumerate(zip(prompts, plist, seeds, strict=True)):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        truncates = p.truncates(vocab)
        out = Completion(index=i, prompt_ids=prompt, seed=seed,
                         support_ids=[] if truncates else None,
                         support_logprobs=[] if truncates else None)
        reqs.append(Request(i, prompt, p, seed, out, truncates))
    return reqs


def record_step(rec, slot_order: list[int], running: dict[int, Request], version: int,
            rows: list[int] | None = None) -> None:
    """Append step records; ``rows[i]`` is the record row of ``slot_order[i]`` (default i).
    The one place records leave the device (``tolist``)."""
    if rows is not None and rows != list(range(rec.tokens.shape[0])):
        index = torch.tensor(rows, device=rec.tokens.device)
        rec = dataclasses.replace(rec, tokens=rec.tokens[index], logprob=rec.logprob[index],
                                  logprob_full=rec.logprob_full[index],
                                  head_ids=rec.head_ids[index],
                                  head_logprobs=rec.head_logprobs[index])
    tokens = rec.tokens.tolist()
    logprob = rec.logprob.tolist()
    logprob_full = logprob if rec.logprob_full is rec.logprob else rec.logprob_full.tolist()
    head_ids = rec.head_ids.tolist()
    head_lp = rec.head_logprobs.tolist()
    has_support = rec.support_ids.shape[1] > 0
    if has_support:
        sup_ids, sup_lp = rec.support_ids.tolist(), rec.support_logprobs.tolist()
        sup_len = rec.support_len.tolist()
    width = rec.head_ids.shape[1]
    for row, s in enumerate(slot_order):
        req = running[s]
        out, k = req.out, req.params.head_k
        out.token_ids.append(tokens[row])
        out.logprobs.append(logprob[row])
        out.logprobs_full.append(logprob_full[row])
        out.head_ids.append(head_ids[row] if k >= width else head_ids[row][:k])
        out.head_logprobs.append(head_lp[row] if k >= width else head_lp[row][:k])
        out.versions.append(version)
        if req.truncates:
            n = sup_len[row]
            out.support_ids.append(sup_ids[row][:n])
            out.support_logprobs.append(sup_lp[row][:n])


__all__ = ["GenerateStats", "Request", "make_requests", "record_step"]
