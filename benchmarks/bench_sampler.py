"""Sampler engine per device and precision recipe: decode throughput and measured mismatch against
the fp32 JAX trainer, with transformers' ``generate()`` on the same model, batch and device in the
same run.

For one tiny Qwen3 (``--size tiny``, the acceptance model; ``--size small`` for bigger
matmuls; random weights saved once in fp32 = the trainer's master weights, nothing downloaded),
every format is exported by the converter (``convert.export.export_hf``), and for each variant:

- ``bf16`` is the engine exactly as ``mixrl-sample`` (and every spawned group) builds it on
  ``--device``: ``Engine(dir, "bf16", device=...)`` with its defaults (``compile="auto"``,
  attention ``auto``); the other recipes' rows use the same defaults. ``bf16+...`` rows vary one
  setting (compile on/off, sdpa/eager attention, an fp8 KV cache);
  ``bf16_vs_fastest_bf16`` is the default's throughput over the fastest ``bf16+`` variant of
  the same numerics (attention / compile variants; the fp8-KV row is a different precision);
  ``fp8+native`` / ``fp8+emulate`` / ``int8+...`` force each quantized kernel, which is how
  ``kernel: auto``'s per-device choice is checked (``sampler_torch.recipes.linear.use_native``;
  a native kernel torch lacks on the device is recorded under ``skipped``);
- ``tokens_per_s``: generated tokens per second of ``Engine.generate`` for ``--batch``
  prompts of ``--prompt-len`` tokens and ``--new-tokens`` new tokens each (temperature 1, no
  truncation, no stop tokens, so every request runs to its length; prefill included), median of
  ``--repeats`` runs after a warm-up run (which also pays any ``torch.compile``,
  ``warmup_seconds``). On the CPU the seconds are this process's CPU time (single-threaded; these
  2 cores are shared, so wall time, ``tokens_per_wall_s``, counts other jobs' slices too); on
  CUDA they are wall time after ``torch.cuda.synchronize``;
- ``kernel``: ``native`` or ``emulate`` (``sampler_torch.recipes.linear.matmul_kernel``, probed
  on the device), ``attention`` and ``compile``: what the engine resolved;
- ``kl_b_p``: mean over the sampled positions of the exact KL(b || p) between the recipe's
  distribution b (teacher-forced through the recipe, KV cache included) and the fp32 trainer's p
  on the same tokens (``trainer_jax.models``, jitted, float32, on JAX's CPU backend);
- ``k3``: the estimator the trainer logs, mean of r - 1 - log r with r = p(x)/b(x) over the
  recipe's own samples (b from the engine's ``logprobs``);
- ``out_of_range``: share of sampled tokens with r outside [0.2, 5] (MIS' default band).

Baseline: transformers' ``generate(do_sample=True, top_k=0, min_new_tokens=new_tokens)`` on the
bf16 export loaded in bf16 (and in fp32) on the same device, same prompts and lengths, same
torch thread count, timed the same way. ``bf16_vs_transformers_bf16`` is the acceptance ratio.

``--runs N`` repeats the throughput measurement N times with the same engines (warm-up and
mismatch once) and records each run's ratios and their min / median / max (``runs``).
Without JAX installed the mismatch columns are null (``--no-mismatch`` skips them anyway).

    .venv/bin/python benchmarks/bench_sampler.py [--size tiny|small] [--device cpu|cuda|cuda:N]
        [--runs 3] [--quick] [--threads 1] [--recipes NAME ...] [--no-mismatch]
        [--out benchmarks/results/bench_sampler[_SIZE][_DEVICE].json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from convert.export import export_hf
from convert.hf_checkpoint import HFCheckpoint
from sampler_torch.device import DeviceError, describe, local_device
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
# name: (registered recipe, recipe overrides, Engine kwargs). Recipe rows run the engine's
# defaults on the device (what mixrl-sample runs); bf16+ rows vary one setting each.
VARIANTS = {name: (name, {}, {}) for name in RECIPES} | {
    "bf16+compile": ("bf16", {}, {"compile": True}),
    "bf16+no_compile": ("bf16", {}, {"compile": False}),
    "bf16+sdpa": ("bf16", {"attention": "sdpa"}, {"compile": False}),
    "bf16+sdpa+compile": ("bf16", {"attention": "sdpa"}, {"compile": True}),
    "bf16+eager": ("bf16", {"attention": "eager"}, {"compile": False}),
    "bf16+eager+compile": ("bf16", {"attention": "eager"}, {"compile": True}),
    "bf16+kv_fp8_e4m3": ("bf16", {"kv_cache_dtype": "fp8_e4m3"}, {}),
    "fp8+kv_fp8_e4m3": ("fp8", {"kv_cache_dtype": "fp8_e4m3"}, {}),
    # each quantized kernel forced, to check kernel: auto's per-device choice (a native kernel
    # torch lacks on the device is recorded as skipped)
    "fp8+native": ("fp8", {"kernel": "native"}, {}),
    "fp8+emulate": ("fp8", {"kernel": "emulate"}, {}),
    "int8+native": ("int8", {"kernel": "native"}, {}),
    "int8+emulate": ("int8", {"kernel": "emulate"}, {}),
}
#: the bf16 variants of the same numerics the default is held against (within 10 % on the CPU)
SAME_NUMERICS = [n for n in VARIANTS if n.startswith("bf16+") and "kv_" not in n]
C_MIN, C_MAX = 0.2, 5.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, repeats: int, device: torch.device):
    """(median seconds, median wall seconds, last output) of ``repeats`` calls of ``fn``.

    Seconds are this process's CPU time on the CPU (on shared cores wall time also counts other
    jobs' slices) and wall time after a device synchronize on CUDA (CPU time there measures the
    host thread waiting on the GPU, not the work).
    """
    cpu, wall, out = [], [], None
    for _ in range(repeats):
        _sync(device)
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        _sync(device)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    seconds = wall if device.type == "cuda" else cpu
    return statistics.median(seconds), statistics.median(wall), out


def _warm(fn, device: torch.device):
    """(warm-up wall seconds, output): the first call pays any ``torch.compile``."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _trainer(src: Path):
    """The fp32 JAX trainer's ``log p`` function on JAX's CPU backend, or None without JAX."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # keep JAX off a GPU the engine is timed on
    try:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        import trainer_jax.models as jax_models
    except ImportError as e:
        print(f"no mismatch columns: {e}", file=sys.stderr)
        return None
    trainer, _ = jax_models.load_hf(src, dtype=jnp.float32)
    step = nnx.jit(lambda m, x: m(x))

    def logp(seqs: list[list[int]]) -> np.ndarray:
        """float32 log p [B, L, V], one jitted call (sequences of equal length)."""
        return np.asarray(jax.nn.log_softmax(step(trainer, jnp.asarray(seqs, jnp.int32)), axis=-1))

    return logp


def _mismatch(engine: Engine, outs, plen: int, trainer_logp) -> dict:
    if trainer_logp is None:
        return {"kl_b_p": None, "k3": None, "out_of_range": None}
    seqs = [c.prompt_ids + c.token_ids for c in outs]
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
    return {"kl_b_p": float(np.mean(kls)), "k3": float(np.mean(r - 1 - log_r)),
            "out_of_range": float(np.mean((r < C_MIN) | (r > C_MAX)))}


class RecipeBench:
    """One variant's engine, warmed up once and timed as often as ``--runs`` asks."""

    def __init__(self, name: str, export: Path, prompts, params, device: torch.device):
        base, overrides, engine_kwargs = VARIANTS[name]
        self.recipe = get_recipe(base, **overrides)
        self.engine = Engine(export, self.recipe, max_batch=len(prompts), device=device,
                             **engine_kwargs)
        self.device, self.prompts, self.params = device, prompts, params
        self.warmup, self.outs = _warm(self.run, device)

    def run(self):
        return self.engine.generate(self.prompts, self.params)

    def measure(self, repeats: int) -> dict:
        seconds, wall, outs = _time(self.run, repeats, self.device)
        n_new = sum(len(c.token_ids) for c in outs)
        return {"tokens_per_s": n_new / seconds, "tokens_per_wall_s": n_new / wall,
                "seconds": seconds, "wall_seconds": wall, "new_tokens": n_new}

    def describe(self) -> dict:
        e = self.engine
        return {"recipe": self.recipe.describe(), "device": e.device.type, "kernel": e.matmul_kernel,
                "attention": e.attention, "compile": e.compile,
                "compiled_decode": e.last_stats.compiled_decode,
                "warmup_seconds": self.warmup, "steps": e.last_stats.steps}


class HFBench:
    """transformers' ``generate`` on the bf16 export in ``dtype`` on ``device``."""

    def __init__(self, path: Path, prompts, new_tokens: int, dtype, device: torch.device):
        self.model = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).eval().to(device)
        self.ids = torch.tensor(prompts, device=device)
        self.new_tokens, self.device, self.dtype = new_tokens, device, dtype
        self.warmup, _ = _warm(self.run, device)

    def run(self):
        ids = self.ids
        with torch.inference_mode():
            return self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                       temperature=1.0, top_k=0, top_p=1.0,
                                       max_new_tokens=self.new_tokens,
                                       min_new_tokens=self.new_tokens, pad_token_id=0,
                                       eos_token_id=None)

    def measure(self, repeats: int) -> dict:
        seconds, wall, out = _time(self.run, repeats, self.device)
        n_new = (out.shape[1] - self.ids.shape[1]) * out.shape[0]
        return {"dtype": str(self.dtype).removeprefix("torch."), "tokens_per_s": n_new / seconds,
                "tokens_per_wall_s": n_new / wall, "seconds": seconds, "wall_seconds": wall,
                "new_tokens": int(n_new)}


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "values": values}


def _ratios(run: dict) -> dict:
    """This run's acceptance ratios (those whose rows were measured)."""
    rec, hf = run["recipes"], run["transformers_generate"]
    out = {}
    if "bf16" in rec:
        out["bf16_vs_transformers_bf16"] = rec["bf16"]["tokens_per_s"] / hf["bfloat16"]["tokens_per_s"]
        out["bf16_vs_transformers_fp32"] = rec["bf16"]["tokens_per_s"] / hf["float32"]["tokens_per_s"]
        same = [n for n in SAME_NUMERICS if n in rec]
        if same:
            best = max(same, key=lambda n: rec[n]["tokens_per_s"])
            out["bf16_vs_fastest_bf16"] = rec["bf16"]["tokens_per_s"] / rec[best]["tokens_per_s"]
            out["fastest_bf16_variant"] = best
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (as mixrl-sample)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1, help="throughput measurements per engine")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for every engine (1: the 2 shared cores of this machine "
                         "make OpenMP spin-waits dominate tiny matmuls)")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats (smoke run)")
    ap.add_argument("--no-mismatch", action="store_true", help="skip the KL / k3 columns (no JAX)")
    ap.add_argument("--recipes", nargs="*", default=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=None,
                    help="default: benchmarks/results/bench_sampler[_SIZE][_DEVICE].json")
    args = ap.parse_args()
    unknown = [n for n in args.recipes if n not in VARIANTS]
    if unknown:
        print(f"bench_sampler: unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    try:
        device = torch.device(local_device(args.device))
    except DeviceError as e:
        print(f"bench_sampler: {e}", file=sys.stderr)
        return 2
    if args.quick:
        args.new_tokens, args.repeats = 16, 1
    if args.out is None:
        suffix = ("" if args.size == "tiny" else f"_{args.size}") + (
            "" if device.type == "cpu" else f"_{device.type}")
        args.out = Path(f"benchmarks/results/bench_sampler{suffix}.json")
    torch.set_num_threads(args.threads)

    rng = np.random.default_rng(0)
    model_cfg = SIZES[args.size]
    prompts = rng.integers(1, model_cfg["vocab_size"], (args.batch, args.prompt_len)).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, head_k=20, seed=0)
    results: dict = {"size": args.size, "model": model_cfg, "batch": args.batch,
                     "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "repeats": args.repeats, "runs": args.runs, "torch_threads": args.threads,
                     "torch": torch.__version__, "device": describe(device),
                     "machine": platform.processor() or platform.machine(),
                     "seconds": "cpu" if device.type == "cpu" else "wall", "recipes": {}}
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
        trainer_logp = None if args.no_mismatch else _trainer(root / "src")
        benches = {}
        results["skipped"] = {}
        for name in args.recipes:
            fmt = get_recipe(VARIANTS[name][0]).weight_format
            try:
                b = RecipeBench(name, exports[fmt], prompts, params, device)
            except RuntimeError as e:  # e.g. kernel: native where torch has none
                results["skipped"][name] = str(e)
                print(f"{name:>20}: skipped ({e})", flush=True)
                continue
            benches[name] = b
            results["recipes"][name] = b.describe() | _mismatch(b.engine, b.outs, args.prompt_len,
                                                                trainer_logp)
        hf = {"bfloat16": HFBench(exports["bf16"], prompts, args.new_tokens, torch.bfloat16, device),
              "float32": HFBench(exports["bf16"], prompts, args.new_tokens, torch.float32, device)}
        runs = []
        for i in range(args.runs):
            run = {"recipes": {n: b.measure(args.repeats) for n, b in benches.items()},
                   "transformers_generate": {k: h.measure(args.repeats) for k, h in hf.items()}}
            run |= _ratios(run)
            runs.append(run)
            print(f"run {i + 1}/{args.runs}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in run.items() if isinstance(v, float)), flush=True)
    # The rows carry the median run's figures (by the bf16-vs-transformers ratio when measured).
    key = "bf16_vs_transformers_bf16" if "bf16_vs_transformers_bf16" in runs[0] else None
    median_run = (sorted(runs, key=lambda r: r[key])[len(runs) // 2] if key else runs[0])
    for name in benches:
        results["recipes"][name] |= median_run["recipes"][name]
        r = results["recipes"][name]
        kl = "" if r["kl_b_p"] is None else f"  KL(b||p) {r['kl_b_p']:.2e}  k3 {r['k3']:.2e}"
        print(f"{name:>20}: {r['tokens_per_s']:8.0f} tok/s  {r['kernel']:7s} {r['attention']:5s} "
              f"compile={r['compile']}{kl}")
    results["transformers_generate"] = median_run["transformers_generate"]
    results |= _ratios(median_run)
    results["runs_detail"] = [{k: v for k, v in r.items() if not isinstance(v, dict)} | {
        "tokens_per_s": {n: x["tokens_per_s"] for n, x in r["recipes"].items()},
        "transformers_tokens_per_s": {n: x["tokens_per_s"]
                                      for n, x in r["transformers_generate"].items()}}
        for r in runs]
    results["runs_spread"] = {k: _spread([r[k] for r in runs]) for k in runs[0]
                              if isinstance(runs[0][k], float)}
    hf_row = results["transformers_generate"]
    print(f"transformers generate: bf16 {hf_row['bfloat16']['tokens_per_s']:.0f} tok/s, "
          f"fp32 {hf_row['float32']['tokens_per_s']:.0f} tok/s")
    for k, v in results["runs_spread"].items():
        print(f"{k}: min {v['min']:.2f} / median {v['median']:.2f} / max {v['max']:.2f} "
              f"over {args.runs} run(s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
