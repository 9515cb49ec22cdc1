"""What generates for a sampler: the torch engine, or an external inference server (SGLang,
vLLM over HTTP) with the same ``generate``/``load_weights`` API; ``open_backend`` builds the one
``mixrl-sample --backend`` names."""

from __future__ import annotations

import os
from collections.abc import Sequence

from mixrl_wire.recipes import BACKENDS
from sampler_torch.backends.http_server import ServerBackend, ServerError
from sampler_torch.backends.sglang import SGLangBackend, SGLangError, server_args, sglang_available
from sampler_torch.backends.vllm import VLLMBackend, VLLMError, vllm_available
from sampler_torch.backends.vllm import server_args as vllm_server_args
from sampler_torch.recipes import Recipe

SERVERS: dict[str, type[ServerBackend]] = {"sglang": SGLangBackend, "vllm": VLLMBackend}


def open_backend(kind: str, model_dir: str | os.PathLike, recipe: Recipe, *,
                 server_url: str | None = None, max_batch: int = 32,
                 server_extra_args: Sequence[str] = (),
                 log_path: str | os.PathLike | None = None, device: str = "cpu",
                 compile: bool | str = "auto"):
    """The backend ``kind`` (a key of ``mixrl_wire.recipes.BACKENDS``) serving ``model_dir``.

    ``engine``: the torch engine in this process, on ``device`` (a resolved torch device,
    ``sampler_torch.device.local_device``), with its per-device defaults (``compile="auto"``
    unless ``compile`` says otherwise, attention ``auto``: what ``benchmarks/bench_sampler.py``'s
    ``bf16`` row measures).
    A server kind attaches to ``server_url`` (a server already holding ``model_dir``) or, without
    it, starts one with the recipe's arguments (plus ``server_extra_args``); ``close()`` stops
    only a server it started.
    """
    if kind not in BACKENDS:
        raise ValueError(f"unknown backend {kind!r}; known: {', '.join(BACKENDS)}")
    if recipe.logit_noise and kind != "engine":  # the dial lives in the engine's sampling step
        raise ValueError(f"logit_noise={recipe.logit_noise} needs --backend engine, not {kind}")
    if recipe.round_weights and kind != "engine":  # the engine's loader rounds the weights
        raise ValueError(f"round_weights={recipe.round_weights[0]}/{recipe.round_weights[1]} needs "
                         f"--backend engine, not {kind}")
    if kind == "engine":
        if server_url:
            raise ValueError("--server-url is for the sglang and vllm backends, not the engine")
        from sampler_torch.engine import Engine

        return Engine(model_dir, recipe, max_batch=max_batch, device=device, compile=compile)
    cls = SERVERS[kind]
    if server_url:
        return cls(server_url, recipe=recipe, model_dir=model_dir)
    return cls.launch(model_dir, recipe, extra_args=server_extra_args, log_path=log_path)


__all__ = ["BACKENDS", "SERVERS", "SGLangBackend", "SGLangError", "ServerBackend", "ServerError",
           "VLLMBackend", "VLLMError", "open_backend", "server_args", "sglang_available",
           "vllm_available", "vllm_server_args"]
