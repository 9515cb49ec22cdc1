"""Attention forward+backward on this backend: the dense reference vs the blocked form per block size.

What ``attention.default_impl`` and ``CPU_BLOCK`` rest on. GQA as in ``bench_forward.py`` (8 query
heads over 4 K/V heads of 32) unless told otherwise; each case is a jitted gradient of
``sum(out ** 2)`` with respect to q, k and v, all implementations timed interleaved, min / median /
max over the repeats. Writes JSON; ``speedup_vs_reference`` is the ratio of medians.

    .venv/bin/python benchmarks/bench_attention.py [--cases 8x256 8x1024] [--blocks 32 64 128 256]
        [--repeats 9] [--out benchmarks/results/bench_attention.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from trainer_jax.models.attention import CPU_BLOCK, attention


def _grad_fn(impl: str, block: int | None, segment_ids):
    options = {} if block is None else {"block": block}

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, segment_ids, impl=impl, **options).astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def bench_case(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, blocks: list[int],
               repeats: int) -> dict:
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim))
    segment_ids = jnp.ones((batch, seq), jnp.int32)
    fns = {"reference": _grad_fn("reference", None, segment_ids)}
    fns.update({f"blocked_{b}": _grad_fn("blocked", b, segment_ids) for b in blocks if b <= seq})
    for fn in fns.values():
        jax.block_until_ready(fn(q, k, v))  # compile
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(q, k, v))
            times[name].append(time.perf_counter() - t0)
    ref = statistics.median(times["reference"])
    return {"batch": batch, "seq_len": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "ms": {name: {"min": round(min(ts) * 1e3, 2), "median": round(statistics.median(ts) * 1e3, 2),
                          "max": round(max(ts) * 1e3, 2)} for name, ts in times.items()},
            "speedup_vs_reference": {name: round(ref / statistics.median(ts), 2)
                                     for name, ts in times.items() if name != "reference"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=["8x256", "8x1024"], help="BATCHxSEQ per case")
    p.add_argument("--blocks", nargs="+", type=int, default=[32, 64, 128, 256])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default="benchmarks/results/bench_attention.json")
    args = p.parse_args()
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases]
    results = {
        "benchmark": "attention fwd+bwd: reference vs blocked per block size",
        "command": "python benchmarks/bench_attention.py " + " ".join(sys.argv[1:]),
        "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()][:1],
        "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(), "cpu_block": CPU_BLOCK,
        "cases": [bench_case(b, t, args.heads, args.kv_heads, args.head_dim, args.blocks, args.repeats)
                  for b, t in cases],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    for case in results["cases"]:
        ms = ", ".join(f"{k} {v['median']:.1f}" for k, v in case["ms"].items())
        print(f"{case['batch']}x{case['seq_len']}: median ms {ms}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
