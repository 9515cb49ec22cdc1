"""The sampler-vs-trainer mismatch probe: what `mixrl-train` runs until the training loop lands.

Each sampler group loads the published weights in its own precision and attention kernel and
samples completions; the fp32 JAX trainer then scores the same tokens. Per group we report the
per-token estimates of KL(b || p) that the objective's diagnostics use:
``k1 = log b - log p`` and ``k3 = r - 1 - log r`` with ``r = p / b``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from convert.qwen3_config import Qwen3Config
from convert.tokenizer import char_tokenizer, special_token_ids
from sampler_torch.models import load_hf as load_sampler_model
from sampler_torch.reference_sampler import sample
from trainer_jax.config import RunConfig
from trainer_jax.models import Qwen3, init_model, load_hf, save_hf

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_policy(cfg: RunConfig, tokenizer_vocab: int) -> tuple[Qwen3, Qwen3Config]:
    m = cfg.model
    if m.hf_dir:
        return load_hf(m.hf_dir)
    qcfg = Qwen3Config(
        vocab_size=tokenizer_vocab, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
        tie_word_embeddings=m.tie_word_embeddings, num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok, moe_intermediate_size=m.moe_intermediate_size)
    return init_model(qcfg, seed=m.seed), qcfg


@nnx.jit(static_argnames=("temperature",))
def token_logprobs(model: Qwen3, ids: jax.Array, temperature: float) -> jax.Array:
    """``log p(ids[:, t+1] | ids[:, :t+1])`` under the temperature-scaled policy, ``[B, T-1]``."""
    logits = model(ids)[:, :-1] / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]


def arithmetic_prompts(n: int, rng: np.random.Generator) -> list[str]:
    return [f"{a}+{b}=" for a, b in rng.integers(0, 100, size=(n, 2))]


def run_probe(cfg: RunConfig, run_dir: str | Path, console=None) -> dict:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tok = char_tokenizer()
    tok_dir = run_dir / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    policy, qcfg = build_policy(cfg, tok.get_vocab_size())
    weights = save_hf(policy, qcfg, run_dir / "weights" / "v0", dtype="float32",
                      tokenizer_dir=tok_dir, overwrite=True)

    rng = np.random.default_rng(cfg.run.seed)
    bos = special_token_ids(tok)["bos"]
    prompts = [[bos] + tok.encode(p).ids for p in arithmetic_prompts(cfg.probe.prompts, rng)]
    stop = (special_token_ids(tok)["eos"],)
    report = {"weights": str(weights), "groups": {}}
    for group in cfg.groups:
        t0 = time.perf_counter()
        sampler = load_sampler_model(weights, dtype=_TORCH_DTYPES[group.dtype])
        sampler.set_attention_impl(group.attention)
        samples = sample(sampler, prompts, max_new_tokens=cfg.probe.max_new_tokens,
                         temperature=cfg.probe.temperature, seed=cfg.run.seed, stop_token_ids=stop)
        sample_s = time.perf_counter() - t0
        k1, k3, n = [], [], 0
        for prompt, s in zip(prompts, samples, strict=True):
            ids = jnp.asarray([prompt + s.token_ids], jnp.int32)
            logp = np.asarray(token_logprobs(policy, ids, cfg.probe.temperature))[0, len(prompt) - 1:]
            logb = np.asarray(s.logprobs)
            log_r = logp - logb
            k1.append(-log_r)
            k3.append(np.expm1(log_r) - log_r)
            n += len(logb)
        k1, k3 = np.concatenate(k1), np.concatenate(k3)
        report["groups"][group.name] = {
            "dtype": group.dtype, "attention": group.attention, "tokens": int(n),
            "k1_mean": float(k1.mean()), "k3_mean": float(k3.mean()),
            "max_abs_log_ratio": float(np.abs(k1).max()), "tokens_per_s": n / sample_s,
            "example": tok.decode(samples[0].token_ids),
        }
    (run_dir / "probe.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
