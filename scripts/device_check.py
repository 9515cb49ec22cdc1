"""The GPU check of issues 17 and 30, part by part; ``scripts/device_check.sh`` runs them all.

    python scripts/device_check.py kernels [--tiny] [--registry PATH]  # (b) fused kernels vs reference
    python scripts/device_check.py jax [--tiny]     # (a) train step with the kernels auto picks
    python scripts/device_check.py torch [--tiny]   # (c) torch fp8 _scaled_mm linear vs bf16
    python scripts/device_check.py train [--tiny]   # (d) mixrl-train, trainer + a sampler on one GPU

Each prints one JSON object. The JAX and torch parts run as separate processes so neither
framework's allocator holds GPU memory while the other is measured (and the JAX parts, like the
trainer, never import torch). ``--tiny`` shrinks every shape so the parts run on a CPU in
seconds (the test suite runs it); its figures mean nothing.

(b) ``device_check_kernels.py``: every fused kernel ``auto`` may pick on this platform against
the reference, each result recorded in the checked-kernel registry (``--registry``, else
``$MIXRL_CHECKED_KERNELS``, else -- but never for ``--tiny`` -- the package's
``trainer_jax/kernels/checked.json``). (d) ``device_check_train.py``.

(a) A random Qwen3-0.6B-shape model (hidden 1,024, 28 layers, 16 query / 8 KV heads, head_dim
128, vocabulary 151,936), bf16 compute over fp32 parameters and AdamW state, full remat, rows of
4,096 tokens: tokens/s of one train step (forward, backward through the fused LM-head
log-sum-exp, AdamW update) and model FLOPs utilisation against the GPU's dense bf16 peak. Model
FLOPs count the useful work once (6 per parameter per token, plus causal attention), never the
recomputation remat adds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling parts

# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by device name, for MFU.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 PCIe": 756.0,
                    "H100": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0,
                    "L4": 121.0, "A10": 125.0}

QWEN3_06B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 tie_word_embeddings=True, rope_theta=1_000_000.0)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


def peak_tflops(device_name: str) -> float | None:
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # most specific name first
        if key in device_name:
            return PEAK_BF16_TFLOPS[key]
    return None


def model_flops_per_token(cfg, seq_len: int, segments: list[int] | None = None) -> float:
    """Forward + backward FLOPs per token: 6 x matmul parameters, plus causal attention over the
    keys each query sees (``segments``: the packed sequences' lengths; default one of seq_len)."""
    d, hd, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    attn = d * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    mlp = 3 * d * cfg.intermediate_size
    matmul_params = layers * (attn + mlp) + d * cfg.vocab_size  # the LM head, tied or not
    # Scores and probs @ V: 4 * hd FLOPs per (query, key, head) forward; a query sees the keys of
    # its own sequence up to itself, L / 2 on average in a sequence of L.
    segments = segments or [seq_len]
    keys_per_query = sum(n * n / 2 for n in segments) / seq_len
    attention = layers * 3 * 4 * hd * cfg.num_attention_heads * keys_per_query
    return 6 * matmul_params + attention


def _timed(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def train_step_check(tiny: bool, attention_impl: str | None, remat: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from convert.qwen3_config import Qwen3Config
    from trainer_jax.kernels.checked import describe_choice
    from trainer_jax.kernels.linear_logsumexp import linear_logsumexp
    from trainer_jax.kernels.linear_logsumexp.names import resolve_impl
    from trainer_jax.models import init_model

    cfg = Qwen3Config(**(TINY if tiny else QWEN3_06B))
    rows, seq = (2, 64) if tiny else (8, 4096)
    model = init_model(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                       attention_impl=attention_impl, remat=remat)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-5), wrt=nnx.Param)
    # The kernels the trainer's ``auto`` picks here: what (b) recorded as checked, else XLA.
    lse_impl = resolve_impl("auto")
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, seq)), jnp.int32)
    # Two sequences per row, so segment masking is exercised as in packed training.
    segments = [seq // 3, seq - seq // 3]
    seg = jnp.asarray(np.repeat([[1] * segments[0] + [2] * segments[1]], rows, 0), jnp.int32)

    @nnx.jit
    def step(model, optimizer, ids, seg):
        def loss_fn(m):
            h = m.hidden_states(ids, segment_ids=seg)[:, :-1].reshape(-1, cfg.hidden_size)
            w = m.lm_head_weight().astype(h.dtype)
            lse, _ = linear_logsumexp(h, w, temperature=1.0, impl=lse_impl)
            target = jnp.einsum("nd,dn->n", h, w[:, ids[:, 1:].reshape(-1)],
                                preferred_element_type=jnp.float32)
            return jnp.mean(lse - target)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    t0 = time.perf_counter()
    first_loss = float(step(model, optimizer, ids, seg))
    compile_s = time.perf_counter() - t0
    times = _timed(lambda: float(step(model, optimizer, ids, seg)), 2 if tiny else 5)
    tokens = rows * seq
    best, median = min(times), sorted(times)[len(times) // 2]
    device = jax.devices()[0]
    name = getattr(device, "device_kind", str(device))
    peak = peak_tflops(name)
    flops = model_flops_per_token(cfg, seq, segments) * tokens
    out = {"model": "tiny" if tiny else "qwen3-0.6b-shape", "rows": rows, "seq_len": seq,
           "dtype": "bfloat16 compute, float32 params and AdamW state", "remat": remat,
           "attention_impl": attention_impl or "auto", "lse_impl": lse_impl,
           "auto": [describe_choice("attention", attention_impl or "auto"),
                    describe_choice("linear_logsumexp", "auto")],
           "device": name, "first_loss": first_loss, "compile_and_first_step_s": compile_s,
           "step_s": {"min": best, "median": median, "max": max(times)},
           "tokens_per_s_median": tokens / median, "model_tflops_per_step": flops / 1e12,
           "peak_bf16_tflops": peak,
           "mfu_median": None if peak is None else flops / median / (peak * 1e12)}
    return out


def fp8_linear_check(tiny: bool) -> dict:
    import numpy as np
    import torch

    from convert.formats import get_codec
    from sampler_torch.recipes.linear import FP8BlockLinear, native_kernel_available

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    tokens, d_in, d_out = (16, 256, 384) if tiny else (8192, 4096, 12288)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((d_out, d_in)) * 0.02).astype(np.float32)
    native = native_kernel_available("fp8")
    fp8 = FP8BlockLinear(get_codec("fp8_block").quantize(w), native=native).to(dev)
    bf16 = torch.nn.Linear(d_in, d_out, bias=False, dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        bf16.weight.copy_(torch.from_numpy(w))
    x = torch.randn(tokens, d_in, dtype=torch.bfloat16, device=dev)

    def run(mod):
        def go():
            with torch.no_grad():
                y = mod(x)
            if cuda:
                torch.cuda.synchronize()
            return y
        return go

    y8, y16 = run(fp8)(), run(bf16)()
    ref = x.double() @ torch.from_numpy(w).to(dev).double().t()
    rel = lambda y: float((y.double() - ref).abs().max() / ref.abs().max())  # noqa: E731
    t8, t16 = _timed(run(fp8), 3 if tiny else 20), _timed(run(bf16), 3 if tiny else 20)
    m8, m16 = sorted(t8)[len(t8) // 2], sorted(t16)[len(t16) // 2]
    return {"shape": [tokens, d_in, d_out], "device": torch.cuda.get_device_name() if cuda else "cpu",
            "fp8_kernel": "_scaled_mm" if native else "emulate",
            "fp8_median_s": m8, "bf16_median_s": m16, "fp8_speedup_over_bf16": m16 / m8,
            "max_rel_err_vs_fp64": {"fp8": rel(y8), "bf16": rel(y16)}}


def _guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # one failing part must not hide the others' figures
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


def registry_path(arg: str | None, tiny: bool) -> str | None:
    """Where (b) records its results: the flag, the env var, else the package's file -- except
    for ``--tiny``, whose toy-shape runs never touch the repository's file unless told to."""
    import os

    if arg or os.environ.get("MIXRL_CHECKED_KERNELS"):
        return arg or os.environ["MIXRL_CHECKED_KERNELS"]
    if tiny:
        return None
    from trainer_jax.kernels.checked import REGISTRY

    return str(REGISTRY)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=["kernels", "jax", "torch", "train"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--attention", default=None, help="attention impl for (a) (default: auto)")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--registry", default=None, help="checked-kernel file (b) writes (see above)")
    ap.add_argument("--timeout", type=float, default=150.0, help="(d): seconds for the whole run")
    args = ap.parse_args()
    if args.part == "kernels":
        from device_check_kernels import run as kernels

        report = {"kernels": _guarded(kernels, args.tiny, registry_path(args.registry, args.tiny))}
    elif args.part == "jax":
        report = {"train_step": _guarded(train_step_check, args.tiny, args.attention, args.remat)}
    elif args.part == "torch":
        report = {"fp8_linear": _guarded(fp8_linear_check, args.tiny)}
    else:
        from device_check_train import run as train

        report = {"mixrl_train": _guarded(train, args.tiny, args.timeout)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
