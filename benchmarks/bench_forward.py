"""Forward+backward tokens/s of the JAX Qwen3 vs transformers' PyTorch Qwen3, same config and batch.

Both compute a next-token cross-entropy and its gradient with respect to every parameter, in fp32
on this CPU, starting from the same HF checkpoint. The loss is the one transformers' own
``ForCausalLMLoss`` computes: labels shifted left and padded with an ignored position, so neither
side copies a ``[:, :-1]`` slice of the logits. The two steps are timed interleaved (JAX, torch,
JAX, ...) so load from other jobs hits both alike; min / median / max over the repeats go to the
JSON and the ratio is of medians. ``--runs N`` repeats the whole comparison N times (fresh models,
fresh compile) and records every run's ratio with their min / median / max, since the ratio moves
by about ±0.08 between runs on a shared 2-core machine. Writes JSON; the README quotes the ratios.

    .venv/bin/python benchmarks/bench_forward.py [--quick] [--repeats N] [--runs N]
        [--attention IMPL] [--out benchmarks/results/bench_forward.json]
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

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from trainer_jax.models import load_hf

SIZES = {
    "dense": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False),
    "moe": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False),
}


def _time_interleaved(fns: dict, repeats: int) -> dict[str, list[float]]:
    for fn in fns.values():
        fn()  # warm-up / compile
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _stats(tokens: int, times: list[float]) -> dict:
    rates = sorted(tokens / t for t in times)
    return {"min": rates[0], "median": statistics.median(rates), "max": rates[-1]}


def bench_one(kind: str, batch: int, seq: int, repeats: int, attention_impl: str | None) -> dict:
    torch.manual_seed(0)
    if kind == "dense":
        hf = Qwen3ForCausalLM(Qwen3Config(**SIZES[kind]))
    else:
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SIZES[kind]))
    hf.train()
    ids_np = np.random.default_rng(0).integers(0, SIZES[kind]["vocab_size"], (batch, seq))
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        model, _ = load_hf(d, attention_impl=attention_impl)

    ids_t = torch.from_numpy(ids_np)
    labels_t = torch.nn.functional.pad(ids_t[:, 1:], (0, 1), value=-100)

    def torch_step():
        hf.zero_grad(set_to_none=True)
        logits = hf(ids_t).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 labels_t.reshape(-1), ignore_index=-100)
        loss.backward()
        return loss

    graphdef, params = nnx.split(model)

    @jax.jit
    def jax_step(params, ids):
        labels = jnp.pad(ids[:, 1:], ((0, 0), (0, 1)))
        weights = (jnp.arange(ids.shape[1]) < ids.shape[1] - 1).astype(jnp.float32)

        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(ids)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return jnp.sum(ce * weights) / (jnp.sum(weights) * ids.shape[0])
        return jax.value_and_grad(loss_fn)(params)

    ids_j = jnp.asarray(ids_np, jnp.int32)
    jax_loss = float(jax_step(params, ids_j)[0])
    torch_loss = torch_step().item()
    times = _time_interleaved({"jax": lambda: jax.block_until_ready(jax_step(params, ids_j)),
                               "torch": torch_step}, repeats)
    tokens = batch * seq
    jax_rate, torch_rate = _stats(tokens, times["jax"]), _stats(tokens, times["torch"])
    ratios = sorted(t / j for j, t in zip(times["jax"], times["torch"], strict=True))  # per interleaved pair
    return {
        "config": SIZES[kind], "batch": batch, "seq_len": seq, "repeats": repeats,
        "attention_impl": attention_impl or "auto",
        "loss_jax": jax_loss, "loss_torch": torch_loss,
        "jax_tokens_per_s": jax_rate, "torch_tokens_per_s": torch_rate,
        "ratio_jax_over_torch": jax_rate["median"] / torch_rate["median"],
        "ratio_per_pair": {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1]},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller batch, fewer repeats")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per side (default 9)")
    p.add_argument("--runs", type=int, default=1, help="whole comparisons, each reported (default 1)")
    p.add_argument("--attention", default=None, help="attention impl (default: auto)")
    p.add_argument("--out", default="benchmarks/results/bench_forward.json")
    args = p.parse_args()
    batch, seq, repeats = (2, 128, 2) if args.quick else (8, 256, 9)
    repeats = args.repeats or repeats
    results = {
        "benchmark": "forward+backward, next-token CE, fp32",
        "command": "python benchmarks/bench_forward.py " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(),
                    "load_average_at_start": os.getloadavg(),
                    "jax": jax.__version__, "torch": torch.__version__},
        "runs": {},
    }
    if args.runs < 1:
        p.error("--runs must be at least 1")
    for kind in SIZES:  # the last run's figures at the top level; every run under all_runs
        runs = [bench_one(kind, batch, seq, repeats, args.attention) for _ in range(args.runs)]
        ratios = sorted(r["ratio_jax_over_torch"] for r in runs)
        results["runs"][kind] = {**runs[-1], "ratio_per_run": [r["ratio_jax_over_torch"] for r in runs],
                                 "ratio_over_runs": {"min": ratios[0], "median": statistics.median(ratios),
                                                     "max": ratios[-1]},
                                 "all_runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    for kind, r in results["runs"].items():
        j, t, pr = r["jax_tokens_per_s"], r["torch_tokens_per_s"], r["ratio_per_pair"]
        print(f"{kind}: jax {j['min']:.0f}/{j['median']:.0f}/{j['max']:.0f} tok/s, torch "
              f"{t['min']:.0f}/{t['median']:.0f}/{t['max']:.0f} (min/median/max); ratio of medians "
              f"{r['ratio_jax_over_torch']:.2f}x, per pair {pr['min']:.2f}/{pr['median']:.2f}/"
              f"{pr['max']:.2f}x (loss {r['loss_jax']:.4f} vs {r['loss_torch']:.4f})")
        o = r["ratio_over_runs"]
        print(f"{kind}: ratio per run " + " / ".join(f"{x:.2f}" for x in r["ratio_per_run"])
              + f"x; min/median/max {o['min']:.2f}/{o['median']:.2f}/{o['max']:.2f}x")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
