"""A plain, obviously-correct sampling loop over the KV cache: the oracle the engine is held to.

Static batch (no slot refill), temperature sampling from the full distribution, per-request
``torch.Generator`` seeds. It records ``log q(x_t)`` of each sampled token under the sampling
temperature. The production engine (continuous batching, truncation, recipes) lives in
``sampler_torch.engine``; this loop stays small so tests can compare against it.
"""

from __future__ import annotations

import dataclasses

import torch

from sampler_torch.models import KVCache, Qwen3ForCausalLM


@dataclasses.dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (hit a stop token, which is kept) or "length"


@torch.no_grad()
def sample(model: Qwen3ForCausalLM, prompts: list[list[int]], *, max_new_tokens: int,
           temperature: float = 1.0, seed: int = 0, stop_token_ids: tuple[int, ...] = (),
           cache_dtype: torch.dtype | None = None) -> list[Sample]:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    b = len(prompts)
    dev = next(model.parameters()).device  # the model's device; draws stay on CPU generators
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    max_prompt = int(lengths.max())
    dtype = cache_dtype or next(model.parameters()).dtype
    cache = KVCache.for_model(model.config, b, max_prompt + max_new_tokens, dtype=dtype, device=dev)
    ids = torch.zeros(b, max_prompt, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    # Right padding: pad tokens are written past each prompt's end and overwritten by decoding.
    logits = model(ids.to(dev), cache=cache)
    last = logits[torch.arange(b, device=dev), lengths - 1]
    gens = [torch.Generator().manual_seed(seed + i) for i in range(b)]
    out = [Sample([], [], "length") for _ in range(b)]
    active = list(range(b))
    pos = lengths.clone()
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(last.float() / temperature, dim=-1).cpu()
        next_tokens = []
        for row, i in enumerate(active):
            tok = int(torch.multinomial(logp[row].exp(), 1, generator=gens[i]))
            out[i].token_ids.append(tok)
            out[i].logprobs.append(float(logp[row, tok]))
            next_tokens.append(tok)
        still = [(row, i) for row, i in enumerate(active) if next_tokens[row] not in stop_token_ids]
        for row, i in enumerate(active):
            if next_tokens[row] in stop_token_ids:
                out[i].finish_reason = "stop"
        if not still:
            break
        rows = torch.tensor([row for row, _ in still])
        active = [i for _, i in still]
        slots = torch.tensor(active, device=dev)
        tokens = torch.tensor(next_tokens)[rows][:, None].to(dev)
        last = model(tokens, positions=pos[slots][:, None], cache=cache, slots=slots)[:, -1]
        pos[slots] += 1
    return out
