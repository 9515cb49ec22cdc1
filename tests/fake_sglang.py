"""A toy SGLang 0.5.21 server on a real local socket, for the SGLang backend's contract tests.

Its JSON follows the ``sglang==0.5.21`` wheel's source (SGLang cannot run on these CPU machines,
so it was read, not recorded): ``entrypoints/http_server.py`` (routes, status codes, bodies of
``/server_info``, ``/model_info``, ``/update_weights_from_disk``, ``/pause_generation``,
``/continue_generation``, ``/weights_checker``, errors as ``{"error": {"message"}}``),
``managers/tokenizer_manager.py`` (``meta_info`` keys, ``output_top_logprobs`` only when
top_logprobs_num > 0, the sampling mask keys), ``utils/weight_versions.py`` (version spans),
``managers/scheduler_components/logprob_result_processor.py`` (``input_token_logprobs`` from
``logprob_start_len``, first entry ``None``), ``managers/scheduler.py`` (the mask's top_k rule) and
``layers/sampler.py`` (logprobs after temperature and before truncation; the mask most probable
first with log b over it; ``SGLANG_RETURN_ORIGINAL_LOGPROB`` gives pre-temperature logprobs).

The "model" is a fixed table of next-token logits per weights version, indexed by the previous
token, so a test knows every distribution exactly. Each token is drawn from the version served
at that moment; with ``token_delay`` a request takes time, holds while the server is paused, and
a reload lands in its middle. Pauses and flushes follow ``managers/scheduler.py`` and
``scheduler_components/weight_updater.py``: ``in_place`` leaves running requests in the batch,
and a cache flush (``flush_cache`` of an update, ``/flush_cache``) fails while any runs (the real
scheduler asserts on the update's; here it is an HTTP 500); ``/flush_cache`` answers plain text,
200 or 400 (``entrypoints/http_server.py``).
"""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
from fake_http import JSONServer

VOCAB = 40


def table(version: str) -> np.ndarray:
    seed = int(version) if str(version).isdigit() else 99
    return np.random.default_rng(seed + 100).normal(size=(VOCAB, VOCAB)) * 2


def logq(version: str, prev: int, temperature: float) -> np.ndarray:
    z = table(version)[prev] / (temperature if temperature > 1e-6 else 1.0)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def kept(lq: np.ndarray, top_p: float, top_k: int) -> np.ndarray:
    """SGLang's joint rule on q: rank < top_k and the mass before the token <= top_p."""
    order = np.argsort(-lq, kind="stable")
    q = np.exp(lq[order])
    k = top_k if top_k > 0 else VOCAB
    return order[(np.cumsum(q) - q <= top_p) & (np.arange(VOCAB) < k)]


def _error(message: str, code: int = 400):
    return code, {"error": {"message": message}}


class FakeSGLang(JSONServer):
    """``FakeSGLang(**server_info overrides)``; ``original_logprob`` plays a server started with
    ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``; ``noop_update`` one that acknowledges a reload and keeps
    its old weights and labels."""

    def __init__(self, **kwargs):
        super().__init__()
        self.reset(**kwargs)

    def reset(self, *, original_logprob: bool = False, noop_update: bool = False,
              token_delay: float = 0.0, **info) -> None:
        """A fresh server state (one socket serves a whole test module: closing one takes 0.5 s)."""
        for name in ("generate", "check_weights"):  # undo a test's stand-in route
            self.__dict__.pop(name, None)
        self.requests.clear()
        self.original_logprob, self.noop_update = original_logprob, noop_update
        self.version, self.model_path = "0", "/exports/v0"
        self.paused: str | None = None
        self.token_delay = token_delay
        self.running = 0        # requests being generated now
        self.produced = 0       # output tokens generated since the reset
        self.flushes = 0        # successful cache flushes
        self._lock = threading.Lock()
        self.switch_after: tuple[int, str] | None = None  # (tokens, version) for the next call
        self.info = {"version": "0.5.21", "model_path": self.model_path, "dtype": "auto",
                     "kv_cache_dtype": "auto", "quantization": None, "sampling_backend": "flashinfer",
                     "speculative_algorithm": None, "rl_on_policy_target": None,
                     "sampling_mask_max_tokens": 4096, "skip_tokenizer_init": True,
                     "sampling_defaults": "openai", "preferred_sampling_params": None,
                     "weight_version": "default", "enable_deterministic_inference": False,
                     "launch_command": "python -m sglang.launch_server --model-path /exports/v0",
                     "frontend": "python", "kv_events": None, **info}

    def route(self, method, path, body, query):
        if method == "GET":
            return {"/health": lambda: (200, None), "/server_info": lambda: (200, self.info),
                    "/model_info": self.model_info}.get(path, lambda: (404, {"detail": "Not Found"}))()
        handler = {"/generate": self.generate, "/update_weights_from_disk": self.update,
                   "/pause_generation": self.pause, "/continue_generation": self.resume,
                   "/weights_checker": self.check_weights, "/flush_cache": self.flush}.get(path)
        return handler(body) if handler else (404, {"detail": "Not Found"})

    def model_info(self):
        return 200, {"model_path": self.model_path, "served_model_name": self.model_path,
                     "tokenizer_path": self.model_path, "is_generation": True,
                     "preferred_sampling_params": None, "weight_version": self.version,
                     "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
                     "disaggregation_mode": "null", "has_image_understanding": False}

    def pause(self, body):
        self.paused = body.get("mode", "abort")
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body):
        self.paused = None
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def flush(self, body):
        with self._lock:
            if self.running:
                return 400, "Flush cache failed.\n"  # plain text, as SGLang answers
            self.flushes += 1
        return 200, "Cache flushed.\n"

    def update(self, body):
        if body.get("flush_cache", True) and self.running:
            return 500, {"detail": "AssertionError: Cache flush failed after updating weights"}
        if body.get("flush_cache", True):
            self.flushes += 1
        if "bad" in body["model_path"]:
            return 400, {"success": False, "message": "Failed to update weights: shape mismatch.\n"
                         "Rolling back to original weights.", "num_paused_requests": 0}
        message = "Succeeded to update model weights."
        if not self.noop_update:
            self.model_path = body["model_path"]
            if body.get("weight_version") is not None:
                self.version = body["weight_version"]
                message += f" Weight version updated to {self.version}."
        return 200, {"success": True, "message": message, "num_paused_requests": 0}

    def check_weights(self, body):
        if (body or {}).get("action", "checksum") != "checksum":
            return 400, {"success": False, "message": "Unsupported action"}
        rank = hashlib.sha256(table(self.version).tobytes()).hexdigest()[:16]
        return 200, {"success": True, "message": "checksum computed",
                     "ranks": [{"checksums": {"model": rank}, "per_gpu_checksum": rank,
                                "parallelism_info": []}],
                     "per_engine_checksum": hashlib.sha256(rank.encode()).hexdigest()}

    def generate(self, body):
        n = len(body["input_ids"])
        per = {k: body.get(k) if isinstance(body.get(k), list) else [body.get(k, d)] * n
               for k, d in (("return_sampling_mask", False), ("sampling_logprobs_mode", None),
                            ("top_logprobs_num", 0), ("logprob_start_len", -1))}
        for mask, mode in zip(per["return_sampling_mask"], per["sampling_logprobs_mode"], strict=True):
            if mode is not None and not mask:
                return _error("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
        for sp, mask in zip(body["sampling_params"], per["return_sampling_mask"], strict=True):
            top_k = 1 if sp.get("temperature", 1.0) < 1e-6 else sp.get("top_k", -1)
            if mask and top_k != 1 and not 1 < top_k <= self.info["sampling_mask_max_tokens"]:
                return _error(f"return_sampling_mask requires top_k=1 for greedy sampling or finite "
                              f"1 < top_k <= {self.info['sampling_mask_max_tokens']}; got "
                              f"top_k={top_k}. Lower top_k or increase --sampling-mask-max-tokens.")
        switch, self.switch_after = self.switch_after, None
        with self._lock:
            self.running += 1
        try:
            return 200, [self._one(ids, sp, *rest, switch) for ids, sp, *rest in zip(
                body["input_ids"], body["sampling_params"], per["top_logprobs_num"],
                per["return_sampling_mask"], per["sampling_logprobs_mode"],
                per["logprob_start_len"], strict=True)]
        finally:
            with self._lock:
                self.running -= 1

    def _one(self, ids, sp, top_n, want_mask, mode, start, switch):
        rng = np.random.default_rng(sp.get("sampling_seed", 42))
        temp, top_p, top_k = sp.get("temperature", 1.0), sp.get("top_p", 1.0), sp.get("top_k", -1)
        if temp < 1e-6:  # SGLang: greedy is top_k = 1 at temperature 1
            temp, top_k = 1.0, 1
        version = self.version
        meta = {"id": "rid", "prompt_tokens": len(ids), "weight_version": version,
                "num_retractions": 0}
        seq, out, lps, tops, masks, mask_lps, spans = list(ids), [], [], [], [], [], []
        finish = {"type": "length", "length": sp["max_new_tokens"]}
        for t in range(sp["max_new_tokens"]):
            while self.paused:  # the scheduler runs no forward while paused
                time.sleep(0.001)
            if switch and t == switch[0]:
                self.version = switch[1]
            version = self.version  # the weights served now
            if not spans or spans[-1]["version"] != version:
                spans.append({"version": version, "start": t, "end": t})
            lq = logq(version, seq[-1], temp)
            keep = kept(lq, top_p, top_k)
            b = np.exp(lq[keep]) / np.exp(lq[keep]).sum()
            x = int(rng.choice(keep, p=b))
            shown = logq(version, seq[-1], 1.0) if self.original_logprob else lq
            seq.append(x)
            out.append(x)
            lps.append([float(shown[x]), x, None])
            tops.append([[float(shown[i]), int(i), None]
                         for i in np.argsort(-shown, kind="stable")[:top_n]])
            masks.append([int(i) for i in keep])  # most probable first, as the sampler packs it
            logb = np.log(b)
            mask_lps.append([float(v) for v in logb] if mode == "support"
                            else float(logb[list(keep).index(x)]))
            spans[-1]["end"] = t + 1
            self.produced += 1
            if self.token_delay:
                time.sleep(self.token_delay)
            if x in sp.get("stop_token_ids", []):
                finish = {"type": "stop", "matched": x}
                break
        inputs = []
        if start is not None and start >= 0:  # prompt logprobs from logprob_start_len
            v = self.version
            inputs = [[None, int(ids[start]), None]] + [
                [float(logq(v, ids[j - 1], 1.0)[ids[j]]), int(ids[j]), None]
                for j in range(start + 1, len(ids))]
        meta.update(finish_reason=finish, input_token_logprobs=inputs, output_token_logprobs=lps,
                    output_token_logprobs_length=len(lps))
        if top_n > 0:
            meta.update(input_top_logprobs=[None] * len(inputs), output_top_logprobs=tops)
        if want_mask:
            meta.update(output_token_sampling_mask=masks, output_token_sampling_logprobs=mask_lps,
                        output_token_sampling_mask_length=len(masks))
        meta.update(reasoning_tokens=0, completion_tokens=len(out), cached_tokens=0)
        if spans:
            meta.update(weight_versions=[{**s} for s in spans], weight_version=spans[-1]["version"])
        else:
            meta["weight_versions"] = [{"version": version, "start": 0, "end": 0}]
        return {"output_ids": out, "meta_info": meta}
