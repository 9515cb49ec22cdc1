"""An SGLang server as a sampler backend: the same ``generate`` / ``load_weights`` API as
``sampler_torch.engine.Engine`` (plus the version probe's ``score`` and ``weights_digest``), over
SGLang's native HTTP API as SGLang 0.5.21 speaks it (``sglang_protocol``: what was read, where).

Start-up (``launch`` or attach by URL): ``/server_info`` is checked (version >= 0.5.21, no flag
that makes records inexact, the recipe's KV cache dtype and quantization), then one tiny
``/generate`` checks the logprob semantics (below); any failure is one ``SGLangError`` line naming
the flag or version to use.

Request (batched, token ids in; the server is launched with ``--skip-tokenizer-init``)::

    POST /generate {"input_ids": [[...], ...],
                    "sampling_params": [{"temperature", "top_p", "top_k" (-1 = off), "min_p": 0,
                                         penalties off, "max_new_tokens", "stop_token_ids",
                                         "sampling_seed", "no_stop_trim": true}, ...],
                    "return_logprob": true, "logprob_start_len": -1,
                    "top_logprobs_num": [head_k, ...],
                    "return_sampling_mask": [truncates, ...],
                    "sampling_logprobs_mode": ["support" | null, ...]}

Response: one object per prompt, ``{"output_ids": [...], "meta_info": {...}}``:
``output_token_logprobs`` ``[[log q, id, null], ...]`` (after temperature, before truncation:
``logprobs_full``), ``output_top_logprobs`` (only when top_logprobs_num > 0: the head),
``output_token_sampling_mask`` / ``output_token_sampling_logprobs`` (the kept set S_t and log b_t
over it, straight from the sampler: ``support_ids`` / ``support_logprobs``, and ``logprobs`` is
log b_t(x_t)), ``finish_reason`` ``{"type": "stop" | "length" | "abort", ...}``,
``weight_versions`` spans and ``weight_version``.

A truncated request needs the mask, which SGLang gives only with top_k = 1 or 1 < top_k <=
``--sampling-mask-max-tokens``: top-p without a top-k is refused here in one line (the config check
``tasks.sampling.top_k <= train.support_k`` asks for the same). Every record is checked on arrival:
log q(s) - log b(s) must be the same log q(S) for every kept id in the head, which a server with
``SGLANG_RETURN_ORIGINAL_LOGPROB`` set (pre-temperature logprobs, invisible in ``/server_info``)
fails whenever the temperature is not 1.

Reload, as the trainer's ``train.partial_rollouts`` says (``set_partial_rollouts``, told at
registration; on by default):

- on: ``/pause_generation {"mode": "in_place"}`` (running requests stay in the batch with their
  KV cache), ``/update_weights_from_disk`` with the version label and ``flush_cache: false``
  (applied at once while paused; SGLang's scheduler asserts on a flush while requests run),
  ``/continue_generation``: a long request spans the reload, its later tokens from the new
  weights over keys/values the old ones computed, told by the ``weight_versions`` spans, as the
  mixrl engine does. The radix cache, which still holds prefixes of the old weights, is flushed
  (``/flush_cache``) as soon as none of this backend's requests is in flight: before the next
  ``generate`` (the next turn of an episode recomputes its context on the new weights) and
  before the version probe is scored (which therefore waits for the running request to end).
- off: wait until every request this backend sent has finished on the old weights, hold new
  ones back (``reload_gate.ReloadGate``), then ``/pause_generation {"mode": "retract"}`` (nothing
  of ours left to retract), ``/update_weights_from_disk`` with the cache flushed,
  ``/continue_generation``.

Either way ``/continue_generation`` follows whatever happened, then ``/model_info`` must name the
new path and version. SGLang >= 0.5.21 has every mode, so the abort-and-resubmit fallback (prompt
plus tokens so far, the server recomputing the KV cache) is not needed here.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

from sampler_torch.backends.http_server import (
    ServerBackend,
    add_token,
    as_version,
    new_completion,
    token_versions,
    truncates,
)
from sampler_torch.backends.reload_gate import ReloadGate
from sampler_torch.backends.sglang_protocol import (
    NEUTRAL,
    PINNED,
    SGLangError,
    check_server_info,
    mask_cap,
    server_args,
)
from sampler_torch.engine.params import Completion, SamplingParams
from sampler_torch.recipes import WeightLoadError, verify_export

#: |log q(s) - log b(s) - log q(S)| allowed between the kept ids of one position (float32 logprobs)
SEMANTICS_TOL = 1e-3

log = logging.getLogger("mixrl.sampler")


class SGLangBackend(ServerBackend):
    """``SGLangBackend(url)`` for a running server (checked at once), or
    ``SGLangBackend.launch(model_dir, recipe)`` (checked once healthy).

    ``check=False`` skips the start-up check (only for a server known to be fine).
    """

    error = SGLangError
    server_name = "sglang server"
    server_package = "sglang"  # the started server's Python must import it

    def __init__(self, url: str, *, check: bool | None = None, **kwargs):
        super().__init__(url, **kwargs)
        self.server_info: dict = {}
        self.mask_cap = 4096
        #: train.partial_rollouts (see the module doc); set by the sampler loop at registration
        self.partial_rollouts = True
        self._gate = ReloadGate()
        self._flush_due = False  # an in-place reload left old-weight prefixes in the radix cache
        if check if check is not None else kwargs.get("process") is None:
            self.check_server()

    @classmethod
    def server_command(cls, model_dir: str | os.PathLike, recipe, *, version: int,
                       host: str, port: int, options: dict) -> tuple[list[str], dict, dict]:
        """``python -m sglang.launch_server`` for ``recipe`` on ``model_dir``."""
        return ([sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
                 "--host", host, "--port", str(port), "--skip-tokenizer-init",
                 "--weight-version", str(version), *server_args(recipe)], {}, {})

    @classmethod
    def launch(cls, *args, **kwargs):
        """``ServerBackend.launch``, then the start-up check (the server is stopped if it fails)."""
        backend = super().launch(*args, **kwargs)
        try:
            backend.check_server()
        except BaseException:
            backend.close()
            raise
        return backend

    def set_partial_rollouts(self, enabled: bool) -> None:
        """The trainer's ``train.partial_rollouts``: reload in place (a request spans it) or
        after every request in flight has finished."""
        self.partial_rollouts = bool(enabled)

    # ------------------------------------------------------------------ start-up check

    def check_server(self) -> None:
        """Ask the server its version and flags, then test its logprob semantics on one token.

        Raises ``SGLangError`` (one line) when the records it would give cannot be exact.
        """
        where = f"sglang server {self.url}"
        info = self._request("GET", "/server_info", None, timeout=min(self.timeout, 60))
        check_server_info(info, self.recipe, where)
        self.server_info, self.mask_cap = info, mask_cap(info)
        k = min(8, self.mask_cap)
        p = SamplingParams(temperature=0.5, top_k=k, head_k=k, max_new_tokens=1, seed=0)
        try:
            self.generate([[0]], p)
        except SGLangError as e:
            raise SGLangError(f"{where} failed the logprob check (temperature 0.5, top_k {k}): "
                              f"{e}") from None

    # ------------------------------------------------------------------ weights

    def load_weights(self, model_dir: str | os.PathLike, version: int, *,
                     verify: bool = True) -> None:
        """Verify the export's manifest here (when ``verify``), then have the server reload it:
        in place under a running request with ``partial_rollouts``, else once our requests in
        flight have finished (see the module doc).

        Raises ``WeightLoadError`` and leaves ``version`` unchanged if a step fails (SGLang rolls
        back to its old weights when a load fails).
        """
        if verify:
            verify_export(model_dir, require_manifest=True)
        if self.partial_rollouts:
            self._reload(str(model_dir), version, in_place=True)
        else:
            with self._gate.drained():  # our requests finish on the old weights first
                self._reload(str(model_dir), version, in_place=False)
        self.version = int(version)
        self.model_dir = model_dir

    def _reload(self, path: str, version: int, *, in_place: bool) -> None:
        mode = "in_place" if in_place else "retract"
        try:
            self._request("POST", "/pause_generation", {"mode": mode})
        except SGLangError as e:
            raise WeightLoadError(f"sglang would not pause ({mode}) for {path}: {e}") from e
        try:
            out = self._request("POST", "/update_weights_from_disk",
                                {"model_path": path, "weight_version": str(version),
                                 "abort_all_requests": False, "flush_cache": not in_place})
        except SGLangError as e:
            raise WeightLoadError(f"sglang refused {path}: {e}") from e
        finally:
            self._request("POST", "/continue_generation", {})
        if not isinstance(out, dict) or not out.get("success"):
            raise WeightLoadError(f"sglang refused {path}: {(out or {}).get('message', out)}")
        if in_place:
            self._flush_due = True
        info = self._request("GET", "/model_info", None)
        served = (str((info or {}).get("model_path")), str((info or {}).get("weight_version")))
        if served != (path, str(version)):
            raise WeightLoadError(f"sglang acknowledged {path} as version {version} but /model_info "
                                  f"says model_path {served[0]}, weight_version {served[1]}")

    def _flush(self) -> bool:
        """``POST /flush_cache`` (a plain-text answer: 200 flushed, 400 requests still running);
        True once flushed."""
        req = urllib.request.Request(self.url + "/flush_cache", data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=min(self.timeout, 60)) as resp:
                code, text = resp.status, ""
        except urllib.error.HTTPError as e:
            code, text = e.code, e.read().decode(errors="replace")[:200]
        except (urllib.error.URLError, OSError) as e:
            log.warning("sglang /flush_cache: %s unreachable (%s)", self.url, e)
            return False
        if code != 200:
            log.warning("sglang /flush_cache refused (HTTP %d: %s); retried before the next "
                        "request", code, text.strip())
            return False
        self._flush_due = False
        return True

    def _flush_if_due(self, *, wait: bool) -> None:
        """Flush the radix cache after an in-place reload once nothing of ours runs; ``wait``
        for the requests in flight to end (the probe must not reuse old-weight prefixes)."""
        if not self._flush_due:
            return
        if wait:
            with self._gate.drained():
                self._flush()
        else:
            self._gate.when_idle(self._flush)

    def weights_digest(self) -> str | None:
        """A fingerprint of the weights the server holds now: ``/weights_checker``'s
        ``per_engine_checksum`` (sha256 over every rank's tensor hashes); None if the route is
        missing."""
        try:
            out = self._request("POST", "/weights_checker", {"action": "checksum"})
        except SGLangError as e:
            if "HTTP 404" in str(e):
                return None
            raise
        if not isinstance(out, dict) or not out.get("success") or not out.get("per_engine_checksum"):
            raise SGLangError(f"/weights_checker checksum failed: {(out or {}).get('message', out)}")
        return str(out["per_engine_checksum"])

    # ------------------------------------------------------------------ the probe

    def score(self, prompts: Sequence[Sequence[int]],
              continuations: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per continuation token t: raw log q(c_t | prompt + c_<t) under the served weights
        (temperature 1, before truncation): SGLang's ``input_token_logprobs`` of a prefill-only
        request (``max_new_tokens`` 0) from ``logprob_start_len = len(prompt) - 1`` (its first
        entry, the prompt's last token, has none)."""
        if len(prompts) != len(continuations):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        todo = [i for i, c in enumerate(continuations) if len(c)]
        out: list[list[float]] = [[] for _ in prompts]
        if not todo:
            return out
        ids = [[*map(int, prompts[i]), *map(int, continuations[i])] for i in todo]
        self._flush_if_due(wait=True)
        body = {"input_ids": ids,
                "sampling_params": [{"max_new_tokens": 0, "temperature": 1.0, **NEUTRAL}
                                    for _ in todo],
                "return_logprob": True, "top_logprobs_num": 0,
                "logprob_start_len": [len(prompts[i]) - 1 for i in todo]}
        with self._gate.request():
            items = self._items(self._request("POST", "/generate", body), len(todo))
        for i, item in zip(todo, items, strict=True):
            want = [int(prompts[i][-1]), *map(int, continuations[i])]
            try:
                got = item["meta_info"]["input_token_logprobs"]
                pairs = [(e[0], int(e[1])) for e in got]
            except (KeyError, TypeError, IndexError, ValueError) as e:
                raise SGLangError(f"/generate scoring item {i} lacks input_token_logprobs ({e})") from None
            if [t for _, t in pairs] != want or any(v is None for v, _ in pairs[1:]):
                raise SGLangError(f"/generate scoring item {i}: input_token_logprobs cover "
                                  f"{[t for _, t in pairs]}, expected {want}")
            out[i] = [float(v) for v, _ in pairs[1:]]
        return out

    # ------------------------------------------------------------------ generation

    def _sampling(self, p: SamplingParams, seed: int) -> dict:
        greedy = p.temperature == 0
        if truncates(p) and not greedy and not 1 <= p.top_k <= self.mask_cap:
            raise SGLangError(
                f"top_p={p.top_p} top_k={p.top_k}: sglang {PINNED} returns the kept set only with "
                f"1 <= top_k <= --sampling-mask-max-tokens ({self.mask_cap}); set "
                "tasks.sampling.top_k" + (" lower" if p.top_k > 0 else "") + " (<= train.support_k)")
        return {"temperature": 0.0 if greedy else p.temperature, "top_p": p.top_p,
                "top_k": 1 if greedy else (p.top_k if p.top_k > 0 else -1), **NEUTRAL,
                "max_new_tokens": p.max_new_tokens, "stop_token_ids": list(p.stop_token_ids),
                "sampling_seed": seed, "no_stop_trim": True}

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """One batched ``/generate`` call; completions in prompt order (see the module doc)."""
        plist, seeds = self.per_request(prompts, params)
        if not prompts:
            return []
        masks = [truncates(p) for p in plist]
        body = {"input_ids": [list(map(int, x)) for x in prompts],
                "sampling_params": [self._sampling(p, s) for p, s in zip(plist, seeds, strict=True)],
                "return_logprob": True, "logprob_start_len": -1,
                "top_logprobs_num": [p.head_k for p in plist], "return_sampling_mask": masks,
                "sampling_logprobs_mode": ["support" if m else None for m in masks]}
        self._flush_if_due(wait=False)
        with self._gate.request():
            items = self._items(self._request("POST", "/generate", body), len(prompts))
        return [self._completion(i, list(map(int, prompt)), p, seed, item)
                for i, (prompt, p, seed, item) in enumerate(zip(prompts, plist, seeds, items,
                                                                strict=True))]

    @staticmethod
    def _items(out, n: int) -> list:
        if isinstance(out, dict):
            out = [out]
        if not isinstance(out, list) or len(out) != n:
            raise SGLangError(f"/generate answered {type(out).__name__} of "
                              f"{len(out) if isinstance(out, list) else 1} items for {n} prompts")
        return out

    def _completion(self, index: int, prompt: list[int], p: SamplingParams, seed: int,
                    item: dict) -> Completion:
        try:
            meta = item["meta_info"]
            finish = meta.get("finish_reason") or {}
            if finish.get("type") == "abort":
                raise SGLangError(f"request {index} aborted by the server: {finish.get('message')}")
            token_ids = [int(t) for t in item["output_ids"]]
            token_lp = meta["output_token_logprobs"]
            top = meta.get("output_top_logprobs") if p.head_k else None
            top = top if top is not None else [[] for _ in token_ids]
            kept_set = truncates(p)
            masks = meta["output_token_sampling_mask"] if kept_set else None
            mask_lp = meta["output_token_sampling_logprobs"] if kept_set else None
        except (KeyError, TypeError, AttributeError) as e:
            raise SGLangError(f"/generate item {index} lacks {e} (was sglang>={PINNED} asked for "
                              "return_logprob and return_sampling_mask?)") from None
        n = len(token_ids)
        lengths = {len(token_lp), len(top), *((len(masks), len(mask_lp)) if kept_set else ())}
        if lengths != {n}:
            raise SGLangError(f"request {index}: {n} output ids but per-token lists of lengths "
                              f"{sorted(lengths)}")
        out = new_completion(index, prompt, p, seed, stopped=finish.get("type") == "stop")
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
            ids, lb = self._support(index, t, x, lq, masks[t], mask_lp[t], ranked)
            out.support_ids.append(ids)
            out.support_logprobs.append(lb)
            out.logprobs.append(lb[ids.index(x)])
        out.versions = token_versions(meta.get("weight_versions"),
                                      as_version(meta.get("weight_version"), self.version), n)
        return out

    @staticmethod
    def _support(index: int, t: int, x: int, lq: float, mask, mask_lp, ranked):
        """The kept set and log b over it, checked against log q (see the module doc)."""
        try:
            ids, lb = [int(s) for s in mask], [float(v) for v in mask_lp]
        except TypeError:
            raise SGLangError(f"request {index} position {t}: the sampling mask has no support "
                              "logprobs (sampling_logprobs_mode 'support' needs sglang>="
                              f"{PINNED})") from None
        if len(ids) != len(lb) or x not in ids:
            raise SGLangError(f"request {index} position {t}: sampled token {x} is outside its "
                              f"sampling mask of {len(ids)} ids ({len(lb)} logprobs)")
        log_mass = lq - lb[ids.index(x)]  # log q(S) = log q(x) - log b(x)
        b = dict(zip(ids, lb, strict=True))
        worst = max((abs(v - b[i] - log_mass) for v, i in ranked if i in b), default=0.0)
        if worst > SEMANTICS_TOL or not math.isfinite(log_mass):
            raise SGLangError(f"request {index} position {t}: log q - log b differs by {worst:.3g} "
                              "across the kept set, so the output logprobs are not the sampled "
                              "distribution's after temperature (is SGLANG_RETURN_ORIGINAL_LOGPROB "
                              "set on the server? unset it)")
        return ids, lb


def sglang_available() -> bool:
    """Whether this host can run a live SGLang server (sglang imports and CUDA is present)."""
    try:
        import sglang  # noqa: F401
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and shutil.which(sys.executable) is not None


__all__ = ["SGLangBackend", "SGLangError", "server_args", "sglang_available"]
