"""A vLLM server as a sampler backend: the same ``generate`` / ``load_weights`` API as
``sampler_torch.engine.Engine`` and ``SGLangBackend``, over vLLM's OpenAI-compatible HTTP server
with token ids in and out.

Wire format followed (vLLM's documented ``/v1/completions`` with its extensions, the RLHF routes
``VLLM_SERVER_DEV_MODE=1`` exposes, and Mask Replay, PR #49577):

Request, one per prompt (each sample has its own seed)::

    POST /v1/completions {"model", "prompt": [token ids], "max_tokens", "temperature",
      "top_p", "top_k" (-1 = off), "seed", "stop_token_ids", "logprobs": N,
      "return_tokens_as_token_ids": true, "return_token_ids": true,
      "skip_special_tokens": false, "include_stop_str_in_output": true,
      "return_sampling_mask": true (only when the request truncates)}

Response ``choices[0]``: ``token_ids``; ``logprobs.token_logprobs[t]`` (the sampled token's) and
``logprobs.top_logprobs[t]`` (``{"token_id:ID": logprob}``, the top N, sometimes plus the sampled
token); ``finish_reason`` ``"stop"|"length"|"abort"``; with ``--return-sampling-mask``,
``sampling_mask``: the kept set S_t per token, as a CSR ``{"token_ids": [...], "offsets":
[0, ..., nnz]}`` (Mask Replay's ``SamplingMask``) or as nested lists (``[[ids of S_0], ...]``,
the later HTTP form); per-token weight versions where a server reports them
(``weight_versions`` spans over output positions, as SGLang writes them), else the request's.

What vLLM's logprobs mean depends on the server's ``--logprobs-mode``:

- ``raw_logprobs`` (what ``launch`` starts): log-softmax of the model's logits, before
  temperature and truncation. At temperature 1 that is log q_t exactly, so with the sampling mask
  every record is exact: log q_t(x_t), the head, and log b_t(s) = log q_t(s) - log q_t(S_t) for
  s in S_t (top logprobs requested deep enough to cover S_t, like the SGLang backend). Greedy
  (temperature 0) is S_t = {argmax} over q at temperature 1, as in the engine.
- ``processed_logprobs``: after temperature and truncation (log b_t). For requests that do not
  truncate that is log q_t at any temperature, and every record is exact.

The combinations neither mode can make exact (temperature other than 0 or 1 under
``raw_logprobs``; truncation under ``processed_logprobs``, whose log q_t(S_t) vLLM does not
report) are refused with one line naming the server flag to use. Without a sampling mask in the
response (servers predating Mask Replay) S_t is rebuilt from the top logprobs with vLLM's own
rule: top-k first, then top-p on the top-k-renormalised distribution keeping every token whose
preceding mass is below p.

Weights: ``load_weights`` verifies the export's manifest here, waits for this backend's requests
in flight, pauses the server until its in-flight requests finish (``POST /pause?mode=wait``),
reloads through vLLM's weight-update endpoint (``POST /update_weights`` with the shared-disk
backend: ``{"update_info": {"path": DIR}}``; servers start with ``--weight-transfer-config
'{"backend": "disk"}'``), and resumes. No request of ours spans a reload, so a request's version
is the one it started under.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sampler_torch.backends.http_server import (
    ServerBackend,
    ServerError,
    add_token,
    new_completion,
    token_versions,
    truncates,
)
from sampler_torch.engine.params import Completion, SamplingParams
from sampler_torch.recipes import Recipe, RecipeError, WeightLoadError, verify_export

#: ``--quantization`` per weight format (vLLM also reads it from ``quantization_config``); vLLM
#: has no loader for SGLang's ``w8a8_int8`` layout, and its mxfp4 is gpt-oss' MoE only.
QUANTIZATION = {"bf16": None, "fp8_block": "fp8", "nvfp4": "modelopt_fp4"}
KV_CACHE_DTYPE = {"auto": "auto", "bf16": "auto", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
SERVED_NAME = "mixrl"


class VLLMError(ServerError):
    """The server refused a request, answered something malformed, or is not reachable."""


def server_args(recipe: Recipe, *, max_logprobs: int = 256) -> list[str]:
    """The ``vllm serve`` arguments that make a server run ``recipe`` for this backend."""
    if recipe.weight_format not in QUANTIZATION:
        raise RecipeError(f"recipe {recipe.name!r}: vLLM has no loader for "
                          f"{recipe.weight_format} dense Qwen3 linears; use the torch engine")
    if recipe.kv_cache_dtype not in KV_CACHE_DTYPE:
        raise RecipeError(f"recipe {recipe.name!r}: vLLM has no KV cache dtype "
                          f"{recipe.kv_cache_dtype!r}")
    args = ["--dtype", recipe.compute_dtype, "--kv-cache-dtype",
            KV_CACHE_DTYPE[recipe.kv_cache_dtype], "--logprobs-mode", "raw_logprobs",
            "--max-logprobs", str(max_logprobs), "--return-sampling-mask",
            "--weight-transfer-config", json.dumps({"backend": "disk"})]
    if QUANTIZATION[recipe.weight_format]:
        args += ["--quantization", QUANTIZATION[recipe.weight_format]]
    return args


def _token_id(key) -> int:
    # return_tokens_as_token_ids writes tokens as "token_id:123"
    text = str(key)
    return int(text.rsplit(":", 1)[-1]) if text.startswith("token_id:") else int(text)


def _logsumexp(values: Sequence[float]) -> float:
    m = max(values)
    return m + math.log(sum(math.exp(v - m) for v in values))


def sampling_mask_rows(mask, n: int) -> list[list[int]] | None:
    """Mask Replay's ``SamplingMask`` (CSR ``token_ids``/``offsets``) or nested lists, as one
    list of kept token ids per output position; ``None`` when the server sent none."""
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
    """vLLM's kept set from log q (most probable first): top-k, then top-p over the top-k
    renormalised distribution keeping tokens whose preceding mass is below p. ``None`` when
    ``ranked`` stops before the set's end is known."""
    if p.temperature == 0:
        return [ranked[0][1]] if ranked else None
    k = p.top_k if p.top_k > 0 else len(ranked)
    if p.top_k > 0 and len(ranked) < p.top_k:
        return None
    head = ranked[:k]
    # Top-p is relative to the top-k set's mass (the whole vocabulary without top-k).
    total = math.exp(_logsumexp([v for v, _ in head])) if p.top_k > 0 else 1.0
    kept, before = [], 0.0
    for v, i in head:
        if kept and before >= p.top_p:
            return [t for _, t in kept]
        kept.append((v, i))
        before += math.exp(v) / total
    # Every shown token was kept: the set is complete only if nothing lies beyond the top-k set.
    return [t for _, t in kept] if p.top_k > 0 or before >= p.top_p else None


class VLLMBackend(ServerBackend):
    """``VLLMBackend(url)`` for a running server, or ``VLLMBackend.launch(model_dir, recipe)``.

    ``logprobs_mode``: the server's ``--logprobs-mode``. ``support_logprobs_num``: top logprobs
    requested when a request truncates without top-k (they must cover the kept set; the
    server's ``--max-logprobs`` must allow it). ``model``: the served model name (else asked of
    ``/v1/models``).
    """

    error = VLLMError
    server_name = "vllm server"

    def __init__(self, url: str, *, logprobs_mode: str = "raw_logprobs", model: str | None = None,
                 max_parallel: int = 64, **kwargs):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got "
                             f"{logprobs_mode!r}")
        super().__init__(url, **kwargs)
        self.logprobs_mode = logprobs_mode
        self._model = model
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="mixrl-vllm")
        # Requests hold the gate shared; a reload holds it alone, so none of ours spans it.
        self._gate = threading.Condition()
        self._in_flight = 0
        self._reloading = False
        self._transfer_ready = False

    @classmethod
    def server_command(cls, model_dir: str | os.PathLike, recipe: Recipe, *, version: int,
                       host: str, port: int, options: dict) -> tuple[list[str], dict, dict]:
        """``vllm serve`` for ``recipe`` on ``model_dir``, with the RLHF routes enabled."""
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
               "--host", host, "--port", str(port), "--served-model-name", SERVED_NAME,
               "--skip-tokenizer-init",
               *server_args(recipe, max_logprobs=options.get("support_logprobs_num", 256))]
        # The pause/resume and weight-update routes exist only in development mode.
        return cmd, {"VLLM_SERVER_DEV_MODE": "1"}, {"model": SERVED_NAME}

    def close(self) -> None:
        """Stop a server this backend launched (a server given by URL is left alone)."""
        super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def model(self) -> str:
        """The served model name requests must carry (asked of ``/v1/models`` once)."""
        if self._model is None:
            models = (self._request("GET", "/v1/models", None) or {}).get("data") or []
            if not models:
                raise VLLMError("GET /v1/models: the server lists no model")
            self._model = str(models[0]["id"])
        return self._model

    # ------------------------------------------------------------------ weights

    def load_weights(self, model_dir: str | os.PathLike, version: int, *,
                     verify: bool = True) -> None:
        """Verify the export's manifest here (when ``verify``), then have the server reload it
        between requests. Raises ``WeightLoadError`` and leaves ``version`` unchanged if any
        step fails (vLLM keeps its weights when a load fails)."""
        if verify:
            verify_export(model_dir, require_manifest=True)
        path = str(Path(model_dir).resolve())
        with self._gate:
            self._reloading = True
            self._gate.wait_for(lambda: self._in_flight == 0)
        try:
            if not self._transfer_ready:
                self._request("POST", "/init_weight_transfer_engine", {"init_info": {}})
                self._transfer_ready = True
            self._request("POST", "/pause?mode=wait", None)
            try:
                self._request("POST", "/update_weights", {"update_info": {"path": path}})
            finally:
                self._request("POST", "/resume", None)
        except VLLMError as e:
            raise WeightLoadError(f"vllm refused {model_dir}: {e}") from e
        finally:
            with self._gate:
                self._reloading = False
                self._gate.notify_all()
        self.version = int(version)
        self.model_dir = model_dir

    # ------------------------------------------------------------------ generation

    def _check_exact(self, p: SamplingParams) -> None:
        if self.logprobs_mode == "raw_logprobs" and p.temperature not in (0, 1):
            raise VLLMError(f"temperature {p.temperature}: vLLM's raw_logprobs are before "
                            "temperature; serve with --logprobs-mode processed_logprobs (exact "
                            "without truncation) or sample at temperature 1")
        if self.logprobs_mode == "processed_logprobs" and truncates(p):
            raise VLLMError("top-p/top-k/greedy under --logprobs-mode processed_logprobs: vLLM "
                            "reports no log q(S) to recover log q; serve with --logprobs-mode "
                            "raw_logprobs and sample at temperature 1")

    def _body(self, prompt: Sequence[int], p: SamplingParams, seed: int) -> dict:
        body = {"model": self.model, "prompt": [int(t) for t in prompt],
                "max_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p,
                "top_k": p.top_k if p.top_k > 0 else -1, "seed": seed,
                "stop_token_ids": list(p.stop_token_ids), "logprobs": self.top_logprobs_needed(p),
                "return_tokens_as_token_ids": True, "return_token_ids": True,
                "skip_special_tokens": False, "include_stop_str_in_output": True}
        if truncates(p):
            body["return_sampling_mask"] = True
        return body

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """One ``/v1/completions`` call per prompt, in parallel; completions in prompt order."""
        plist, seeds = self.per_request(prompts, params)
        if not prompts:
            return []
        for p in plist:
            self._check_exact(p)
        with self._gate:
            self._gate.wait_for(lambda: not self._reloading)
            self._in_flight += 1
            version = self.version
        try:
            futures = [self._pool.submit(self._request, "POST", "/v1/completions",
                                         self._body(prompt, p, seed))
                       for prompt, p, seed in zip(prompts, plist, seeds, strict=True)]
            answers = [f.result() for f in futures]
        finally:
            with self._gate:
                self._in_flight -= 1
                self._gate.notify_all()
        return [self._completion(i, [int(t) for t in prompt], p, seed, answer, version)
                for i, (prompt, p, seed, answer) in enumerate(zip(prompts, plist, seeds, answers,
                                                                  strict=True))]

    def _completion(self, index: int, prompt: list[int], p: SamplingParams, seed: int,
                    answer: dict, version: int) -> Completion:
        try:
            choice = answer["choices"][0]
            lp = choice["logprobs"]
            token_lp, top = lp["token_logprobs"], lp["top_logprobs"]
            ids = choice.get("token_ids")
            ids = [int(t) for t in ids] if ids is not None else [_token_id(t) for t in lp["tokens"]]
        except (KeyError, TypeError, IndexError) as e:
            raise VLLMError(f"/v1/completions answer {index} lacks {e} (were logprobs and "
                            "token ids returned?)") from None
        if choice.get("finish_reason") == "abort":
            raise VLLMError(f"request {index} aborted by the server")
        n = len(ids)
        if len(token_lp) != n or len(top) != n:
            raise VLLMError(f"request {index}: {n} output ids but {len(token_lp)} logprobs and "
                            f"{len(top)} top-logprob lists")
        kept_set = truncates(p)
        masks = sampling_mask_rows(choice.get("sampling_mask"), n) if kept_set else None
        out = new_completion(index, prompt, p, seed, stopped=choice.get("finish_reason") == "stop")
        for t, x in enumerate(ids):
            lq = float(token_lp[t])
            logq = {_token_id(k): float(v) for k, v in (top[t] or {}).items()}
            logq.setdefault(x, lq)
            ranked = sorted(((v, i) for i, v in logq.items()), key=lambda e: (-e[0], e[1]))
            add_token(out, p, x, lq, ranked)
            if not kept_set:
                out.logprobs.append(lq)
                continue
            kept = masks[t] if masks is not None else rebuilt_support(p, ranked)
            if kept is None:
                raise VLLMError(f"request {index} position {t}: {len(ranked)} top logprobs do "
                                "not reach the end of the top-p set and the server sent no "
                                "sampling mask; raise support_logprobs_num")
            if x not in kept:
                raise VLLMError(f"request {index} position {t}: sampled token {x} is outside "
                                "its sampling mask")
            missing = [s for s in kept if s not in logq]
            if missing:
                raise VLLMError(f"request {index} position {t}: the sampling mask has "
                                f"{len(kept)} tokens but only {len(logq)} logprobs came back; "
                                "raise support_logprobs_num (and the server's --max-logprobs)")
            kept = sorted(kept, key=lambda s: (-logq[s], s))
            log_mass = _logsumexp([logq[s] for s in kept])
            out.support_ids.append(kept)
            out.support_logprobs.append([logq[s] - log_mass for s in kept])
            out.logprobs.append(lq - log_mass)
        out.versions = token_versions(choice.get("weight_versions"), version, n)
        return out


def vllm_available() -> bool:
    """Whether this host can run a live vLLM server (vllm imports and CUDA is present)."""
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() and shutil.which(sys.executable) is not None


__all__ = ["VLLMBackend", "VLLMError", "rebuilt_support", "sampling_mask_rows", "server_args",
           "vllm_available"]
