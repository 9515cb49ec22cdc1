"""What an SGLang server must speak for mixrl's records to be exact, pinned to SGLang 0.5.21, and
the start-up check that refuses, in one line, a server that cannot give exact records.

Read from the ``sglang==0.5.21`` wheel's source (SGLang cannot run on this project's CPU-only
machines, so nothing here was observed live):

- ``srt/layers/sampler.py`` ``Sampler.forward``: logits / temperature, softmax, sample; the
  returned logprobs are ``log(probs)`` -- after temperature, before top-k/top-p (our
  ``logprobs_full``) -- unless the environment variable ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set
  (then before temperature) or ``--rl-on-policy-target`` is (then a bf16 log-softmax). Greedy
  requests are top_k = 1 at temperature 1 (``sampling/sampling_params.py``). 0.4.6 returned them
  top-p-renormalised (``top_p_normalize_probs_torch``); 0.5.5 already returned them unrenormalised.
- ``return_sampling_mask`` (from 0.5.16) + ``sampling_logprobs_mode: "support"`` (from 0.5.21):
  ``meta_info["output_token_sampling_mask"]`` (the kept set the sampler drew from, most probable
  first) and ``meta_info["output_token_sampling_logprobs"]`` (log b over that set), built by
  ``Sampler._build_sampling_mask_output`` from the sampler's own filtered weights: the exact
  behaviour record, for every sampling backend but ``ascend``. The scheduler
  (``managers/scheduler.py``) refuses a mask unless top_k = 1 or 1 < top_k <=
  ``--sampling-mask-max-tokens`` (default 4096), and refuses it with speculative decoding.
- ``meta_info["weight_versions"]`` (from 0.5.19; ``utils/weight_versions.py``
  ``add_weight_versions_to_meta_info``): ``[{"version", "start", "end"}]`` spans over output
  positions, recorded when ``/update_weights_from_disk`` changes the version mid-request.
- ``/server_info`` (``entrypoints/http_server.py``): the resolved server arguments plus
  ``"version"``; ``/model_info``: ``model_path`` and ``weight_version`` now served.
- ``/pause_generation`` ``{"mode": "abort" | "retract" | "in_place"}`` (``managers/io_struct.py``
  ``PauseGenerationReqInput``; the modes are there in 0.5.14, 0.5.5 has the route without them),
  ``/continue_generation``.
- ``/weights_checker`` ``{"action": "checksum"}`` -> ``per_engine_checksum`` (sha256 over the
  per-rank tensor hashes; ``managers/tokenizer_control_mixin.py`` ``check_weights``).

``/generate``'s ``sampling_params`` fall back to the model's ``generation_config.json``
(``--sampling-defaults model``, the default) and ``--preferred-sampling-params`` for every key a
request leaves out (``tokenizer_manager.py``), so every request sets each key that shapes the
distribution (``DISTRIBUTION_KEYS``).
"""

from __future__ import annotations

import json
import re

from sampler_torch.backends.http_server import ServerError
from sampler_torch.recipes import Recipe, RecipeError

#: the oldest SGLang whose /generate returns every field the records need (pyproject's extra)
MIN_VERSION = (0, 5, 21)
PINNED = ".".join(map(str, MIN_VERSION))

#: ``--quantization`` per weight format (checkpoints also carry it in ``quantization_config``)
QUANTIZATION = {"bf16": None, "fp8_block": "fp8", "nvfp4": "modelopt_fp4",
                "w8a8_int8": "w8a8_int8"}
KV_CACHE_DTYPE = {"auto": "auto", "bf16": "bf16", "fp8_e4m3": "fp8_e4m3",
                  "fp8_e5m2": "fp8_e5m2"}
_KV_SAME = {"auto": {"auto", "bf16", "bfloat16"}, "bf16": {"auto", "bf16", "bfloat16"}}

#: every ``sampling_params`` key that changes the distribution sampled from, with the value
#: meaning "off" (temperature, top_p and top_k are set per request)
NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
           "repetition_penalty": 1.0, "min_new_tokens": 0}
DISTRIBUTION_KEYS = {"temperature", "top_p", "top_k", *NEUTRAL}


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
            KV_CACHE_DTYPE[recipe.kv_cache_dtype], "--sampling-defaults", "openai"]
    if QUANTIZATION[recipe.weight_format]:
        args += ["--quantization", QUANTIZATION[recipe.weight_format]]
    return args


def parse_version(text) -> tuple[int, ...] | None:
    """``"0.5.21"``, ``"0.5.21.post1"``, ``"0.5.22.dev3+g1234"`` -> ``(0, 5, 21)``; None if not a
    version."""
    m = re.match(r"^\s*(\d+)\.(\d+)\.(\d+)", str(text or ""))
    return tuple(int(x) for x in m.groups()) if m else None


def check_server_info(info: dict, recipe: Recipe, where: str) -> None:
    """Refuse, in one line naming the flag or version to use, a server (``/server_info``) whose
    records cannot be exact or that does not run ``recipe``. Raises ``SGLangError``."""
    if not isinstance(info, dict):
        raise SGLangError(f"{where}: /server_info answered {type(info).__name__}, not an object")
    version = parse_version(info.get("version"))
    if version is None or version < MIN_VERSION:
        raise SGLangError(f"{where} runs sglang {info.get('version', '(version unknown)')}; mixrl needs "
                          f"sglang>={PINNED} (its sampling masks with support logprobs and "
                          "per-token weight versions): pip install 'sglang>=" + PINNED + "'")
    spec = info.get("speculative_algorithm")
    if spec not in (None, "", "NONE", "none"):
        raise SGLangError(f"{where} runs --speculative-algorithm {spec}: SGLang returns no sampling "
                          "mask with speculative decoding; start it without --speculative-algorithm")
    if info.get("sampling_backend") == "ascend":
        raise SGLangError(f"{where} runs --sampling-backend ascend, which captures no sampling mask; "
                          "use --sampling-backend flashinfer or pytorch")
    if info.get("rl_on_policy_target"):
        raise SGLangError(f"{where} runs --rl-on-policy-target {info['rl_on_policy_target']}: its "
                          "logprobs are a bf16 log-softmax, not the distribution sampled from; "
                          "start it without --rl-on-policy-target")
    kv, want_kv = str(info.get("kv_cache_dtype") or "auto"), KV_CACHE_DTYPE.get(recipe.kv_cache_dtype)
    if want_kv is not None and kv not in _KV_SAME.get(want_kv, {want_kv}):
        raise SGLangError(f"{where} runs --kv-cache-dtype {kv} but recipe {recipe.name!r} needs "
                          f"--kv-cache-dtype {want_kv}")
    quant, want_q = info.get("quantization"), QUANTIZATION.get(recipe.weight_format)
    if quant and quant != want_q:  # unset: taken from the checkpoint's quantization_config
        raise SGLangError(f"{where} runs --quantization {quant} but recipe {recipe.name!r} needs "
                          + (f"--quantization {want_q}" if want_q else "no --quantization"))
    dtype = str(info.get("dtype") or "auto")
    same = {"auto", recipe.compute_dtype, *(("float",) if recipe.compute_dtype == "float32" else ())}
    if dtype not in same:
        raise SGLangError(f"{where} runs --dtype {dtype} but recipe {recipe.name!r} computes in "
                          f"{recipe.compute_dtype}: start it with --dtype {recipe.compute_dtype}")
    preferred = info.get("preferred_sampling_params") or {}
    if isinstance(preferred, str):
        try:
            preferred = json.loads(preferred)
        except json.JSONDecodeError:
            preferred = {"(unparsed)": preferred}
    extra = sorted(set(preferred) - DISTRIBUTION_KEYS - {"max_new_tokens", "stop", "stop_token_ids",
                                                         "ignore_eos", "no_stop_trim",
                                                         "skip_special_tokens"})
    if extra:
        raise SGLangError(f"{where} runs --preferred-sampling-params with {', '.join(extra)}, which "
                          "would change the distribution mixrl records; start it without them")


def mask_cap(info: dict) -> int:
    """The server's ``--sampling-mask-max-tokens`` (4096 when it does not say)."""
    try:
        return int(info.get("sampling_mask_max_tokens") or 4096)
    except (TypeError, ValueError):
        return 4096


__all__ = ["DISTRIBUTION_KEYS", "KV_CACHE_DTYPE", "MIN_VERSION", "NEUTRAL", "PINNED", "QUANTIZATION",
           "SGLangError", "check_server_info", "mask_cap", "parse_version", "server_args"]
