"""An SGLang server as a sampler backend: the same ``generate`` / ``load_weights`` API as
``sampler_torch.engine.Engine``, over SGLang's native HTTP API.

Wire format followed: SGLang's ``/generate`` and ``/update_weights_from_disk`` as of the 0.5 line
(``sglang/srt/managers/io_struct.py`` ``GenerateReqInput`` / ``UpdateWeightFromDiskReqInput``,
``tokenizer_manager`` ``meta_info``), including the two newer additions this project relies on
when present -- ``return_sampling_mask`` (PR #27408: ``output_token_sampling_mask``,
``output_token_sampling_logprobs``) and per-token weight-version spans (``weight_versions``) --
with fallbacks for servers that predate them (checked down to the 0.4.6 the ``sglang`` extra
pins):

Request (batched, token ids in, ``--skip-tokenizer-init`` servers return no text)::

    POST /generate {"input_ids": [[...], ...],
                    "sampling_params": [{"temperature", "top_p", "top_k" (-1 = off),
                                         "max_new_tokens", "stop_token_ids",
                                         "sampling_seed", "no_stop_trim": true}, ...],
                    "return_logprob": true, "logprob_start_len": -1,
                    "top_logprobs_num": [N, ...], "return_sampling_mask": [bool, ...]}

Response: one object per prompt, ``{"output_ids": [...], "meta_info": {...}}`` with
``meta_info["output_token_logprobs"] = [[logprob, token_id, text|null], ...]`` (SGLang's logprob
is after temperature and before top-k/top-p: our ``logprob_full``),
``meta_info["output_top_logprobs"] = [[[logprob, token_id, text|null], ...] per position]``,
``meta_info["finish_reason"] = {"type": "stop"|"length"|"abort", ...}``,
``meta_info["weight_version"]`` (a string) and, on newer servers,
``meta_info["weight_versions"] = [{"version", "start", "end"}, ...]`` over output positions.

Conversion to the behaviour record (``docs/design.md`` section 3), per token t with sampled
x_t and log q_t from SGLang:

- with the native sampling mask: S_t = ``output_token_sampling_mask[t]`` and
  log b_t(x_t) = ``output_token_sampling_logprobs[t]``, so log q_t(S_t) = log q_t(x_t) - log b_t(x_t)
  and every support token's log b_t(s) = log q_t(s) - log q_t(S_t), with log q_t(s) from the
  top logprobs (requested deep enough to cover S_t; an uncovered support is an error);
- without it: S_t is rebuilt from the top logprobs with SGLang's own rule (most probable first,
  rank < top_k, mass before <= top_p), which needs the top list to reach past S_t's end;
- ``head`` = the first ``head_k`` top logprobs; ``versions`` from the spans, else the response's
  single ``weight_version`` (servers without spans pause or finish requests across an update).

Greedy (temperature 0) follows SGLang: top_k = 1 at temperature 1.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Sequence

from sampler_torch.backends.http_server import (
    ServerBackend,
    ServerError,
    add_token,
    as_version,
    new_completion,
    token_versions,
    truncates,
)
from sampler_torch.engine.params import Completion, SamplingParams
from sampler_torch.recipes import Recipe, RecipeError, WeightLoadError, verify_export

#: ``--quantization`` per weight format (checkpoints also carry it in ``quantization_config``)
QUANTIZATION = {"bf16": None, "fp8_block": "fp8", "nvfp4": "modelopt_fp4",
                "w8a8_int8": "w8a8_int8"}
KV_CACHE_DTYPE = {"auto": "auto", "bf16": "bf16", "fp8_e4m3": "fp8_e4m3",
                  "fp8_e5m2": "fp8_e5m2"}


class SGLangError(ServerError):
    """The server refused a request, answered something malformed, or is not reachable."""


def server_args(recipe: Recipe) -> list[str]:
    """The ``sglang.launch_server`` arguments that make a server run ``recipe``."""
    if recipe.weight_format not in QUANTIZATION:
        raise RecipeError(f"recipe {recipe.name!r}: SGLang serves {recipe.weight_format} only for "
                          "gpt-oss-style MoE experts, not Qwen3; use the torch engine")
    if recipe.kv_cache_dtype not in KV_CACHE_DTYPE:
        raise RecipeError(f"recipe {recipe.name!r}: SGLang has no KV cache dtype "
                          f"{recipe.kv_cache_dtype!r}")
    args = ["--dtype", recipe.compute_dtype, "--kv-cache-dtype",
            KV_CACHE_DTYPE[recipe.kv_cache_dtype]]
    if QUANTIZATION[recipe.weight_format]:
        args += ["--quantization", QUANTIZATION[recipe.weight_format]]
    return args


class SGLangBackend(ServerBackend):
    """``SGLangBackend(url)`` for a running server, or ``SGLangBackend.launch(model_dir, recipe)``.

    ``support_logprobs_num``: how many top logprobs to request when a request truncates and has
    no top-k (they must cover the kept set; see the module docstring).
    """

    error = SGLangError
    server_name = "sglang server"

    def __init__(self, url: str, *, native_sampling_mask: bool = True, **kwargs):
        super().__init__(url, **kwargs)
        self.native_sampling_mask = native_sampling_mask

    @classmethod
    def server_command(cls, model_dir: str | os.PathLike, recipe: Recipe, *, version: int,
                       host: str, port: int, options: dict) -> tuple[list[str], dict, dict]:
        """``python -m sglang.launch_server`` for ``recipe`` on ``model_dir``."""
        return ([sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
                 "--host", host, "--port", str(port), "--skip-tokenizer-init",
                 "--weight-version", str(version), *server_args(recipe)], {}, {})

    # ------------------------------------------------------------------ weights

    def load_weights(self, model_dir: str | os.PathLike, version: int, *,
                     verify: bool = True) -> None:
        """Verify the export's manifest here (when ``verify``), then have the server reload it.

        Raises ``WeightLoadError`` and leaves ``version`` unchanged if either step fails (SGLang
        keeps serving its old weights when a load fails).
        """
        if verify:
            verify_export(model_dir, require_manifest=True)
        try:
            out = self._request("POST", "/update_weights_from_disk",
                                {"model_path": str(model_dir), "weight_version": str(version),
                                 "abort_all_requests": False})
        except SGLangError as e:
            raise WeightLoadError(f"sglang refused {model_dir}: {e}") from e
        if not isinstance(out, dict) or not out.get("success"):
            raise WeightLoadError(f"sglang refused {model_dir}: "
                                  f"{(out or {}).get('message', out)}")
        self.version = int(version)
        self.model_dir = model_dir

    # ------------------------------------------------------------------ generation

    def _payload(self, prompts, plist, seeds, native: bool) -> dict:
        sampling, top_n, masks = [], [], []
        for p, seed in zip(plist, seeds, strict=True):
            sampling.append({"temperature": p.temperature, "top_p": p.top_p,
                             "top_k": p.top_k if p.top_k > 0 else -1,
                             "max_new_tokens": p.max_new_tokens,
                             "stop_token_ids": list(p.stop_token_ids),
                             "sampling_seed": seed, "no_stop_trim": True})
            top_n.append(self.top_logprobs_needed(p))
            masks.append(truncates(p))
        body = {"input_ids": [list(map(int, x)) for x in prompts], "sampling_params": sampling,
                "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": top_n}
        if native and any(masks):
            body["return_sampling_mask"] = masks
        return body

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """One batched ``/generate`` call; completions in prompt order (see the module doc)."""
        plist, seeds = self.per_request(prompts, params)
        if not prompts:
            return []
        try:
            out = self._request("POST", "/generate",
                                self._payload(prompts, plist, seeds, self.native_sampling_mask))
        except SGLangError as e:
            if not (self.native_sampling_mask and "return_sampling_mask" in str(e)):
                raise
            # A server without the sampling-mask primitive: rebuild supports from top logprobs.
            self.native_sampling_mask = False
            out = self._request("POST", "/generate", self._payload(prompts, plist, seeds, False))
        if isinstance(out, dict):
            out = [out]
        if not isinstance(out, list) or len(out) != len(prompts):
            raise SGLangError(f"/generate answered {type(out).__name__} of "
                              f"{len(out) if isinstance(out, list) else 1} items for "
                              f"{len(prompts)} prompts")
        return [self._completion(i, list(map(int, prompt)), p, seed, item)
                for i, (prompt, p, seed, item) in enumerate(zip(prompts, plist, seeds, out,
                                                                strict=True))]

    def _completion(self, index: int, prompt: list[int], p: SamplingParams, seed: int,
                    item: dict) -> Completion:
        try:
            meta = item["meta_info"]
            token_ids = [int(t) for t in item["output_ids"]]
            token_lp = meta["output_token_logprobs"]
            top = meta.get("output_top_logprobs") or [[] for _ in token_ids]
            finish = meta.get("finish_reason") or {}
        except (KeyError, TypeError) as e:
            raise SGLangError(f"/generate item {index} lacks {e} (was return_logprob honoured?)") from None
        if finish.get("type") == "abort":
            raise SGLangError(f"request {index} aborted by the server: {finish.get('message')}")
        n = len(token_ids)
        if len(token_lp) != n or len(top) != n:
            raise SGLangError(f"request {index}: {n} output ids but {len(token_lp)} logprobs and "
                              f"{len(top)} top-logprob lists")
        kept_set = truncates(p)
        out = new_completion(index, prompt, p, seed, stopped=finish.get("type") == "stop")
        masks = meta.get("output_token_sampling_mask")
        mask_lp = meta.get("output_token_sampling_logprobs")
        for t, x in enumerate(token_ids):
            lq, tok = float(token_lp[t][0]), int(token_lp[t][1])
            if tok != x:
                raise SGLangError(f"request {index} position {t}: logprob is for token {tok}, "
                                  f"output id is {x}")
            ranked = sorted(((float(e[0]), int(e[1])) for e in top[t]), key=lambda e: -e[0])
            add_token(out, p, x, lq, ranked)
            if not kept_set:
                out.logprobs.append(lq)
                continue
            if masks is not None and mask_lp is not None:
                ids, lb = self._native_support(index, t, x, lq, masks[t], float(mask_lp[t]), ranked)
            else:
                ids, lb = self._rebuilt_support(index, t, x, p, ranked)
            out.support_ids.append(ids)
            out.support_logprobs.append(lb)
            out.logprobs.append(lb[ids.index(x)])
        out.versions = self._versions(meta, n)
        return out

    @staticmethod
    def _native_support(index, t, x, lq, mask, lb_x, ranked):
        logq = {i: v for v, i in ranked}
        ids = sorted((int(s) for s in mask), key=lambda s: -logq.get(s, -math.inf))
        if x not in ids:
            raise SGLangError(f"request {index} position {t}: sampled token {x} is outside its "
                              "sampling mask")
        missing = [s for s in ids if s not in logq]
        if missing:
            raise SGLangError(f"request {index} position {t}: the sampling mask has "
                              f"{len(ids)} tokens but only {len(ranked)} top logprobs came back; "
                              "raise support_logprobs_num")
        log_mass = lq - lb_x  # log q(S) = log q(x) - log b(x)
        return ids, [logq[s] - log_mass for s in ids]

    @staticmethod
    def _rebuilt_support(index, t, x, p: SamplingParams, ranked):
        # SGLang's rule on q: rank < top_k and probability mass before the token <= top_p.
        k = 1 if p.temperature == 0 else (p.top_k if p.top_k > 0 else math.inf)
        top_p = 1.0 if p.temperature == 0 else p.top_p
        kept, before, closed = [], 0.0, False
        for rank, (v, i) in enumerate(ranked):
            if rank >= k or before > top_p:
                closed = True
                break
            kept.append((v, i))
            before += math.exp(v)
        closed = closed or before > top_p or len(kept) >= k  # the next token would be cut
        if not closed:
            raise SGLangError(f"request {index} position {t}: {len(ranked)} top logprobs do not "
                              "reach the end of the top-p set; raise support_logprobs_num")
        ids = [i for _, i in kept]
        if x not in ids:
            raise SGLangError(f"request {index} position {t}: sampled token {x} is outside the "
                              "top-k/top-p set rebuilt from the top logprobs")
        m = max(v for v, _ in kept)
        log_mass = m + math.log(sum(math.exp(v - m) for v, _ in kept))
        return ids, [v - log_mass for v, _ in kept]

    def _versions(self, meta: dict, n: int) -> list[int]:
        single = as_version(meta.get("weight_version"), self.version)
        return token_versions(meta.get("weight_versions"), single, n)


def sglang_available() -> bool:
    """Whether this host can run a live SGLang server (sglang imports and CUDA is present)."""
    try:
        import sglang  # noqa: F401
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and shutil.which(sys.executable) is not None


__all__ = ["SGLangBackend", "SGLangError", "server_args", "sglang_available"]
