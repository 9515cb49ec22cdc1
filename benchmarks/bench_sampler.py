"""Sampler engine per precision recipe: decode throughput and measured mismatch against the fp32
JAX trainer, with transformers' ``generate()`` on the same model and batch in the same run.

For one tiny Qwen3 (``--size tiny``, the acceptance model; ``--size small`` for bigger
matmuls; random weights saved once in fp32 = the trainer's master weights), every format is
exported by the converter (``convert.export.export_hf``), and for each recipe variant:

- ``tokens_per_s``: generated tokens per CPU second of ``Engine.generate`` for ``--batch``
  prompts of ``--prompt-len`` tokens and ``--new-tokens`` new tokens each (temperature 1, no
  truncation, no stop tokens, so every request runs to its length; prefill included), median of
  ``--repeats`` runs after a warm-up run (which also pays any ``torch.compile``,
  ``warmup_seconds``). Single-threaded CPU time is the primary figure because these 2 cores are
  shared: wall time (``tokens_per_wall_s``, also recorded) counts other jobs' slices too;
- ``kl_b_p``: mean over the sampled positions of the exact KL(b || p) between the recipe's
  distribution b (teacher-forced through the recipe, KV cache included) and the fp32 trainer's p
  on the same tokens (``trainer_jax.models``, jitted, float32);
- ``k3``: the estimator the trainer logs, mean of r - 1 - log r with r = p(x)/b(x) over the
  recipe's own samples (b from the engine's ``logprobs``);
- ``out_of_range``: share of sampled tokens with r outside [0.2, 5] (MIS' default band).

Baseline: transformers' ``generate(do_sample=True, top_k=0, min_new_tokens=new_tokens)`` on the
bf16 export loaded in bf16 (and in fp32), same prompts and lengths, same torch thread count,
timed the same way. ``bf16_vs_transformers_bf16`` is the acceptance ratio (>= 2 wanted).

    .venv/bin/python benchmarks/bench_sampler.py [--size tiny|small] [--quick] [--threads 1]
        [--recipes NAME ...] [--out benchmarks/results/bench_sampler.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from transformers import Qwen3Config, Qwen3ForCausalLM

import trainer_jax.models as jax_models
from convert.export import export_hf
from convert.hf_checkpoint import HFCheckpoint
from sampler_torch.engine import Engine, SamplingParams
from sampler_torch.recipes import RECIPES, get_recipe

SIZES = {
    # The acceptance model: tiny, so per-token engine overhead (what an engine controls) shows.
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 tie_word_embeddings=False),
    # Bigger matmuls: closer to the kernel-bound regime where both sides run the same GEMMs.
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                  tie_word_embeddings=False),
}
# name: (registered recipe, recipe overrides, Engine kwargs). The compiled decode step applies
# where it can (dense bf16-weight models with a plain KV cache); other recipes run eagerly.
VARIANTS = {name: (name, {}, {"compile": True}) for name in RECIPES} | {
    "bf16+no_compile": ("bf16", {}, {"compile": False}),
    "bf16+kv_fp8_e4m3": ("bf16", {"kv_cache_dtype": "fp8_e4m3"}, {}),
    "fp8+kv_fp8_e4m3": ("fp8", {"kv_cache_dtype": "fp8_e4m3"}, {}),
    "bf16+eager_attention": ("bf16", {"attention": "eager"}, {"compile": True}),
}
C_MIN, C_MAX = 0.2, 5.0


def _median_time(fn, repeats: int):
    """(median CPU seconds, median wall seconds, warm-up wall seconds, last output).

    CPU time of this (single-threaded) process is the primary figure: on shared cores, wall
    time also counts other jobs' time slices.
    """
    t0 = time.perf_counter()
    out = fn()  # warm-up (and torch.compile)
    warmup = time.perf_counter() - t0
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall), warmup, out


def _trainer_logprobs(trainer, seqs: list[list[int]]) -> np.ndarray:
    """float32 log p [B, L, V] of the fp32 JAX trainer, one jitted call (sequences equal length)."""
    logits = nnx.jit(lambda m, x: m(x))(trainer, jnp.asarray(seqs, jnp.int32))
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def bench_recipe(name: str, export: Path, prompts, params, repeats, trainer_logp) -> dict:
    base, overrides, engine_kwargs = VARIANTS[name]
    recipe = get_recipe(base, **overrides)
    engine = Engine(export, recipe, max_batch=len(prompts), **engine_kwargs)
    seconds, wall, warmup, outs = _median_time(lambda: engine.generate(prompts, params), repeats)
    n_new = sum(len(c.token_ids) for c in outs)
    seqs = [c.prompt_ids + c.token_ids for c in outs]
    plen = len(prompts[0])
    logp = trainer_logp(seqs)                       # trainer on the recipe's own samples
    log_b_sampled = np.array([c.logprobs for c in outs])
    tokens = np.array([c.token_ids for c in outs])
    pos = plen - 1 + np.arange(tokens.shape[1])
    log_p_sampled = np.take_along_axis(logp[:, pos], tokens[..., None], -1)[..., 0]
    log_r = log_p_sampled - log_b_sampled
    r = np.exp(log_r)
    # Exact KL(b || p) at the same positions: b from the recipe, teacher-forced.
    kls = []
    for i, logits in enumerate(engine.logits(seqs)):
        lb = torch.log_softmax(logits[pos], -1).numpy()
        kls.append((np.exp(lb) * (lb - logp[i, pos])).sum(-1))
    return {"recipe": recipe.describe(), "engine": engine_kwargs, "tokens_per_s": n_new / seconds,
            "tokens_per_wall_s": n_new / wall, "cpu_seconds": seconds, "wall_seconds": wall,
            "warmup_seconds": warmup, "new_tokens": n_new, "kl_b_p": float(np.mean(kls)),
            "k3": float(np.mean(r - 1 - log_r)),
            "out_of_range": float(np.mean((r < C_MIN) | (r > C_MAX))),
            "steps": engine.last_stats.steps}


def bench_hf_generate(path: Path, prompts, new_tokens: int, repeats: int, dtype) -> dict:
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.tensor(prompts)

    def run():
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)

    seconds, wall, _, out = _median_time(run, repeats)
    n_new = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"dtype": str(dtype).removeprefix("torch."), "tokens_per_s": n_new / seconds,
            "tokens_per_wall_s": n_new / wall, "cpu_seconds": seconds, "wall_seconds": wall,
            "new_tokens": int(n_new)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for every engine (1: the 2 shared cores of this machine "
                         "make OpenMP spin-waits dominate tiny matmuls)")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats (smoke run)")
    ap.add_argument("--recipes", nargs="*", default=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=None,
                    help="default: benchmarks/results/bench_sampler[_SIZE].json")
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.repeats = 16, 1
    if args.out is None:
        suffix = "" if args.size == "tiny" else f"_{args.size}"
        args.out = Path(f"benchmarks/results/bench_sampler{suffix}.json")
    torch.set_num_threads(args.threads)

    rng = np.random.default_rng(0)
    model_cfg = SIZES[args.size]
    prompts = rng.integers(1, model_cfg["vocab_size"], (args.batch, args.prompt_len)).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, head_k=20, seed=0)
    results: dict = {"size": args.size, "model": model_cfg, "batch": args.batch,
                     "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
                     "torch_threads": args.threads, "torch": torch.__version__,
                     "machine": platform.processor() or platform.machine(), "recipes": {}}
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**model_cfg)).eval().save_pretrained(root / "src")
        src = HFCheckpoint(root / "src")
        exports = {}
        for fmt in sorted({get_recipe(VARIANTS[n][0]).weight_format for n in args.recipes}
                          | {"bf16"}):
            exports[fmt] = export_hf(HFCheckpoint(root / "src").tensors(), src.config,
                                     root / fmt, fmt)
        trainer, _ = jax_models.load_hf(root / "src", dtype=jnp.float32)

        def trainer_logp(seqs):
            return _trainer_logprobs(trainer, seqs)

        for name in args.recipes:
            fmt = get_recipe(VARIANTS[name][0]).weight_format
            res = bench_recipe(name, exports[fmt], prompts, params, args.repeats, trainer_logp)
            results["recipes"][name] = res
            print(f"{name:>22}: {res['tokens_per_s']:8.0f} tok/s  KL(b||p) {res['kl_b_p']:.2e}  "
                  f"k3 {res['k3']:.2e}  out-of-range {res['out_of_range']:.4f}", flush=True)
        hf_bf16 = bench_hf_generate(exports["bf16"], prompts, args.new_tokens, args.repeats,
                                    torch.bfloat16)
        hf_fp32 = bench_hf_generate(exports["bf16"], prompts, args.new_tokens, args.repeats,
                                    torch.float32)
    results["transformers_generate"] = {"bfloat16": hf_bf16, "float32": hf_fp32}
    if "bf16" in results["recipes"]:
        results["bf16_vs_transformers_bf16"] = (results["recipes"]["bf16"]["tokens_per_s"]
                                                / hf_bf16["tokens_per_s"])
        results["bf16_vs_transformers_fp32"] = (results["recipes"]["bf16"]["tokens_per_s"]
                                                / hf_fp32["tokens_per_s"])
    print(f"transformers generate: bf16 {hf_bf16['tokens_per_s']:.0f} tok/s, "
          f"fp32 {hf_fp32['tokens_per_s']:.0f} tok/s")
    if "bf16_vs_transformers_bf16" in results:
        print(f"engine bf16 / transformers bf16 = {results['bf16_vs_transformers_bf16']:.2f}x "
              f"(/ fp32: {results['bf16_vs_transformers_fp32']:.2f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
