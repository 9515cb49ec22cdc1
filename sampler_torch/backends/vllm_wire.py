"""What vLLM 0.32's HTTP server speaks, as the vLLM backend uses it: the start-up checks on
its version and flags, the token-in/token-out ``POST /inference/v1/generate`` request and answer,
prompt logprobs for ``score``, and the ``/weight_checker`` digest. Pure functions over JSON (the
backend class in ``vllm.py`` does the HTTP), each checked against vLLM 0.32.0's source:

- ``vllm/entrypoints/scale_out/token_in_token_out/{api_router,protocol,serving}.py``: the request
  is ``{"token_ids", "sampling_params": vLLM SamplingParams, "model", "output_mode": "tokens"}``;
  the answer's ``choices[0]`` holds ``token_ids``, ``finish_reason``, ``weight_versions``
  (``[{"version", "start", "end"}]`` over output positions, ``vllm/outputs.py``
  ``WeightVersionSpan``), ``sampling_mask`` (nested lists) and ``logprobs.content[t]`` =
  ``{"token_id", "logprob", "rank", "top_logprobs": [{"token_id", "logprob", "rank"}]}``, whose
  top list is the sampled token first and then the best others, cut at ``logprobs`` entries in
  all (so a request asks for one more than it needs). ``-inf`` arrives as ``-9999.0``.
- ``prompt_logprobs`` (top-level, one ``{"<id>": {"logprob", "rank", "decoded_token"}}`` per
  prompt position, ``None`` first) scores a continuation; prompt rows skip the sampling
  processors, so they are log-softmax of the raw logits whatever ``--logprobs-mode`` says
  (``vllm/v1/worker/gpu_model_runner.py`` ``_get_prompt_logprobs_dict``).
- Kept sets: the V1 sampler (``vllm/v1/sample/ops/topk_topp_sampler.py``
  ``apply_top_k_top_p_pytorch``) masks logits below the k-th largest (ties at the k-th value
  stay), then, over the top-k-renormalised distribution sorted ascending, every token whose
  cumulative mass is <= 1 - p: a token is kept while the mass of the tokens above it is < p.
- ``--return-sampling-mask`` (``vllm/config/vllm.py`` ``_verify_sampling_replay_config``)
  needs Model Runner V2 (Triton; the CPU build falls back to V1 and refuses to start),
  ``--logprobs-mode processed_logprobs`` and ``top_k > 0`` on every request
  (``vllm/v1/engine/input_processor.py``): its logprobs are then the kept-set distribution, and
  log q -- which every record carries (``logprobs_full``, the head) -- is nowhere in the answer.
  So this backend runs ``raw_logprobs`` without the mask and rebuilds each kept set from the raw
  top logprobs with the sampler's own rule; an attached server with the mask on is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence

from sampler_torch.backends.http_server import (
    ServerError,
    add_token,
    new_completion,
    token_versions,
    truncates,
)
from sampler_torch.engine.params import Completion, SamplingParams

#: the oldest vLLM with every route and field used (``/inference/v1/generate`` with
#: ``weight_versions``, ``/pause?mode=keep``, ``/weight_checker``, ``reload_weights``)
MIN_VERSION = (0, 32)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
#: extra top logprobs a top-k request asks for, to see ties at the k-th value
TIE_SLACK = 8
#: the worker extension ``launch`` starts servers with (``vllm_worker/mixrl_vllm_worker.py``)
WORKER_EXTENSION = "mixrl_vllm_worker.MixrlWorkerExtension"


class VLLMError(ServerError):
    """The server refused a request, answered something malformed, is not reachable, or runs
    with flags whose records could not be exact."""


# ---------------------------------------------------------------------------- start-up checks

def parse_version(text: str) -> tuple[int, int]:
    """``"0.32.0"`` / ``"0.32.1.dev3+g..."`` -> ``(0, 32)``; ``(0, 0)`` when unreadable."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", str(text))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_version(text: str) -> None:
    """Refuse a server older than ``MIN_VERSION`` in one line."""
    if parse_version(text) < MIN_VERSION:
        need = ".".join(map(str, MIN_VERSION))
        raise VLLMError(f"vLLM {text} is too old for this backend: use vllm>={need} "
                        "(/inference/v1/generate with weight_versions, /pause?mode=keep, "
                        "/weight_checker)")


def check_config(config: Mapping, *, logprobs_needed: int) -> dict:
    """What the backend needs from ``/server_info``'s ``vllm_config``; refuses, in one line
    naming the flag, a server whose records could not be exact. Returns ``{"logprobs_mode",
    "max_logprobs", "device", "worker_extension", "model"}``."""
    model = config.get("model_config") or {}
    mode = model.get("logprobs_mode", "raw_logprobs")
    if mode not in LOGPROBS_MODES:
        raise VLLMError(f"the server runs --logprobs-mode {mode}: logits are not log q; "
                        "serve with --logprobs-mode raw_logprobs")
    if model.get("return_sampling_mask"):
        raise VLLMError("the server runs --return-sampling-mask, which in vLLM 0.32 forces "
                        "processed logprobs and top_k > 0 (no log q in any answer); serve "
                        "with --no-return-sampling-mask --logprobs-mode raw_logprobs")
    max_logprobs = int(model.get("max_logprobs", 20))
    if 0 <= max_logprobs < logprobs_needed:
        raise VLLMError(f"the server's --max-logprobs {max_logprobs} cannot return the "
                        f"{logprobs_needed} top logprobs a kept set may need; serve with "
                        f"--max-logprobs {logprobs_needed}")
    return {"logprobs_mode": mode, "max_logprobs": max_logprobs,
            "device": str((config.get("device_config") or {}).get("device", "")),
            "worker_extension": str((config.get("parallel_config") or {})
                                    .get("worker_extension_cls") or ""),
            "model": str(model.get("model", ""))}


def check_generate_route(status: int, answer) -> None:
    """What ``POST /inference/v1/generate`` with an empty body answered: a validation error
    means the route is there; 403 is vLLM's "scale-out endpoints are disabled"."""
    if status == 403:
        raise VLLMError("the server answers /inference/v1/generate with 403 (scale-out "
                        "endpoints disabled): start it with --enable-scale-out")
    if status == 404:
        raise VLLMError("the server has no /inference/v1/generate: use vllm>=0.32 started "
                        "with --enable-scale-out")


# ---------------------------------------------------------------------------- generation

def generate_body(prompt: Sequence[int], p: SamplingParams, seed: int, *, model: str | None,
                  num_logprobs: int) -> dict:
    """One ``/inference/v1/generate`` request: token ids in, ``num_logprobs`` top logprobs
    (plus the sampled token's) per output token, token ids out."""
    params = {"temperature": p.temperature, "top_p": p.top_p, "top_k": max(p.top_k, 0),
              "seed": seed, "max_tokens": p.max_new_tokens,
              "stop_token_ids": [int(t) for t in p.stop_token_ids], "logprobs": num_logprobs,
              "detokenize": False, "skip_special_tokens": False}
    body = {"token_ids": [int(t) for t in prompt], "sampling_params": params,
            "output_mode": "tokens"}
    if model:
        body["model"] = model
    return body


def score_body(prompt: Sequence[int], continuation: Sequence[int], *,
               model: str | None) -> dict:
    """A request whose prompt logprobs score ``continuation`` after ``prompt`` (one token is
    generated and ignored)."""
    body = {"token_ids": [int(t) for t in (*prompt, *continuation)],
            "sampling_params": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 0,
                                "max_tokens": 1, "prompt_logprobs": 0, "detokenize": False},
            "output_mode": "tokens"}
    if model:
        body["model"] = model
    return body


def scores(answer: Mapping, prompt_len: int, continuation: Sequence[int]) -> list[float]:
    """log q(c_t | prompt + c_<t) per continuation token from a ``score_body`` answer."""
    rows = answer.get("prompt_logprobs")
    n = prompt_len + len(continuation)
    if not isinstance(rows, list) or len(rows) != n:
        raise VLLMError(f"prompt_logprobs: expected {n} rows, got "
                        f"{len(rows) if isinstance(rows, list) else rows!r}")
    out = []
    for t, token in enumerate(continuation):
        row = rows[prompt_len + t] or {}
        entry = row.get(str(int(token)), row.get(int(token)))
        if entry is None:
            raise VLLMError(f"prompt_logprobs row {prompt_len + t} lacks token {token}")
        out.append(float(entry["logprob"] if isinstance(entry, Mapping) else entry))
    return out


def logsumexp(values: Sequence[float]) -> float:
    m = max(values)
    return m + math.log(sum(math.exp(v - m) for v in values))


def sampling_mask_rows(mask, n: int) -> list[list[int]] | None:
    """A sampling mask as one list of kept token ids per output position: 0.32's nested lists
    or Mask Replay's CSR ``{"token_ids", "offsets"}``; ``None`` when the server sent none."""
    if mask is None:
        return None
    if isinstance(mask, dict):
        ids, offsets = list(mask["token_ids"]), list(mask["offsets"])
        if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != len(ids) or any(
                b < a for a, b in zip(offsets, offsets[1:], strict=False)):
            raise VLLMError(f"sampling_mask: offsets {offsets[:4]}... do not delimit "
                            f"{len(ids)} token ids into {n} rows")
        return [[int(i) for i in ids[a:b]] for a, b in zip(offsets, offsets[1:], strict=False)]
    rows = [[int(i) for i in row] for row in mask]
    if len(rows) != n:
        raise VLLMError(f"sampling_mask has {len(rows)} rows for {n} output tokens")
    return rows


def rebuilt_support(p: SamplingParams, ranked: list[tuple[float, int]]) -> list[int] | None:
    """vLLM's kept set from log q (``ranked``: (log q, id), most probable first): top-k with
    ties at the k-th value kept, then top-p over the top-k renormalised distribution keeping
    tokens whose preceding mass is below p. ``None`` when ``ranked`` stops before the set's end
    is known."""
    if not ranked:
        return None
    if p.temperature == 0:
        return [ranked[0][1]]
    head = ranked
    if p.top_k > 0:
        if len(ranked) <= p.top_k:
            return None
        kth = ranked[p.top_k - 1][0]
        end = p.top_k
        while end < len(ranked) and ranked[end][0] >= kth:
            end += 1
        if end == len(ranked):
            return None  # the ties may go on past the shown list
        head = ranked[:end]
    # Top-p is relative to the top-k set's mass (the whole vocabulary without top-k).
    total = math.exp(logsumexp([v for v, _ in head])) if p.top_k > 0 else 1.0
    kept, before = [], 0.0
    for v, i in head:
        if kept and before >= p.top_p:
            return kept
        kept.append(i)
        before += math.exp(v) / total
    # Every shown token was kept: the set is complete only if nothing lies beyond the top-k set.
    return kept if p.top_k > 0 or before >= p.top_p else None


def completion(index: int, prompt: list[int], p: SamplingParams, seed: int, answer: Mapping,
               version: int) -> Completion:
    """The behaviour record of one ``/inference/v1/generate`` answer (raw logprobs at
    temperature 1 or 0, or processed logprobs without truncation; see the module docstring)."""
    try:
        choice = answer["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        content = (choice.get("logprobs") or {})["content"]
    except (KeyError, TypeError, IndexError) as e:
        raise VLLMError(f"/inference/v1/generate answer {index} lacks {e} (were logprobs "
                        "requested?)") from None
    if choice.get("finish_reason") == "abort":
        raise VLLMError(f"request {index} aborted by the server")
    n = len(ids)
    if content is None or len(content) != n:
        raise VLLMError(f"request {index}: {n} output ids but "
                        f"{len(content) if content is not None else 0} logprob entries")
    kept_set = truncates(p)
    masks = sampling_mask_rows(choice.get("sampling_mask"), n) if kept_set else None
    out = new_completion(index, prompt, p, seed, stopped=choice.get("finish_reason") == "stop")
    for t, (x, entry) in enumerate(zip(ids, content, strict=True)):
        if int(entry["token_id"]) != x:
            raise VLLMError(f"request {index} position {t}: logprobs are for token "
                            f"{entry['token_id']}, the output has {x}")
        lq = float(entry["logprob"])
        logq = {int(e["token_id"]): float(e["logprob"]) for e in entry.get("top_logprobs") or ()}
        logq.setdefault(x, lq)
        ranked = sorted(((v, i) for i, v in logq.items()), key=lambda e: (-e[0], e[1]))
        add_token(out, p, x, lq, ranked)
        if not kept_set:
            out.logprobs.append(lq)
            continue
        kept = masks[t] if masks is not None else rebuilt_support(p, ranked)
        if kept is None:
            raise VLLMError(f"request {index} position {t}: {len(ranked)} top logprobs do "
                            "not reach the end of the kept set; raise support_logprobs_num "
                            "(and the server's --max-logprobs)")
        if p.temperature == 0 and lq >= ranked[0][0]:
            kept = [x]  # greedy among tied maxima: the sampler's argmax
        if x not in kept:
            raise VLLMError(f"request {index} position {t}: sampled token {x} is outside "
                            "its kept set")
        missing = [s for s in kept if s not in logq]
        if missing:
            raise VLLMError(f"request {index} position {t}: the kept set has {len(kept)} "
                            f"tokens but only {len(logq)} logprobs came back; raise "
                            "support_logprobs_num (and the server's --max-logprobs)")
        kept = sorted(kept, key=lambda s: (-logq[s], s))
        log_mass = logsumexp([logq[s] for s in kept])
        out.support_ids.append(kept)
        out.support_logprobs.append([logq[s] - log_mass for s in kept])
        out.logprobs.append(lq - log_mass)
    out.versions = token_versions(choice.get("weight_versions"), version, n)
    return out


# ---------------------------------------------------------------------------- weights

def weights_digest(answer: Mapping) -> str:
    """One fingerprint of ``/weight_checker``'s ``{"checksums": {name: sha256}}``.

    On vLLM's CPU runner packed linear layers hash as empty tensors (their weights live in a
    oneDNN handle), so there it covers embeddings and norms only."""
    checksums = answer.get("checksums")
    if not isinstance(checksums, Mapping) or not checksums:
        raise VLLMError(f"/weight_checker answered no checksums: {json.dumps(answer)[:200]}")
    text = "\n".join(f"{k}={checksums[k]}" for k in sorted(checksums))
    return hashlib.sha256(text.encode()).hexdigest()


__all__ = ["LOGPROBS_MODES", "MIN_VERSION", "TIE_SLACK", "VLLMError", "WORKER_EXTENSION",
           "check_config", "check_generate_route", "check_version", "completion",
           "generate_body", "parse_version", "rebuilt_support", "sampling_mask_rows",
           "score_body", "scores", "weights_digest"]
