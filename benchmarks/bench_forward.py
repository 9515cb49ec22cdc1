"""Forward+backward tokens/s of the JAX Qwen3 vs transformers' PyTorch Qwen3, same config and batch.

Both compute a next-token cross-entropy and its gradient with respect to every parameter, in fp32
on this CPU, starting from the same HF checkpoint. Writes JSON; the README quotes the ratio.

    .venv/bin/python benchmarks/bench_forward.py [--quick] [--out benchmarks/results/bench_forward.json]
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


def _time(fn, repeats: int) -> float:
    fn()  # warm-up / compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_one(kind: str, batch: int, seq: int, repeats: int) -> dict:
    torch.manual_seed(0)
    if kind == "dense":
        hf = Qwen3ForCausalLM(Qwen3Config(**SIZES[kind]))
    else:
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SIZES[kind]))
    hf.train()
    ids_np = np.random.default_rng(0).integers(0, SIZES[kind]["vocab_size"], (batch, seq))
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        model, _ = load_hf(d)

    ids_t = torch.from_numpy(ids_np)

    def torch_step():
        hf.zero_grad(set_to_none=True)
        logits = hf(ids_t).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 ids_t[:, 1:].reshape(-1))
        loss.backward()
        return loss

    graphdef, params = nnx.split(model)

    @jax.jit
    def jax_step(params, ids):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()
        return jax.value_and_grad(loss_fn)(params)

    ids_j = jnp.asarray(ids_np, jnp.int32)
    jax_loss = float(jax_step(params, ids_j)[0])
    torch_loss = torch_step().item()
    t_jax = _time(lambda: jax.block_until_ready(jax_step(params, ids_j)), repeats)
    t_torch = _time(torch_step, repeats)
    tokens = batch * seq
    return {
        "config": SIZES[kind], "batch": batch, "seq_len": seq,
        "loss_jax": jax_loss, "loss_torch": torch_loss,
        "jax_tokens_per_s": tokens / t_jax, "torch_tokens_per_s": tokens / t_torch,
        "ratio_jax_over_torch": t_torch / t_jax,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller batch, fewer repeats")
    p.add_argument("--out", default="benchmarks/results/bench_forward.json")
    args = p.parse_args()
    batch, seq, repeats = (2, 128, 2) if args.quick else (8, 256, 5)
    results = {
        "benchmark": "forward+backward, next-token CE, fp32",
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(),
                    "jax": jax.__version__, "torch": torch.__version__},
        "runs": {kind: bench_one(kind, batch, seq, repeats) for kind in SIZES},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    for kind, r in results["runs"].items():
        print(f"{kind}: jax {r['jax_tokens_per_s']:.0f} tok/s, torch {r['torch_tokens_per_s']:.0f} tok/s, "
              f"ratio {r['ratio_jax_over_torch']:.2f}x (loss {r['loss_jax']:.4f} vs {r['loss_torch']:.4f})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
