"""One-shot accelerator check of the Pallas kernels (run where a GPU/TPU is present).

    python -m trainer_jax.kernels.linear_logsumexp.device_check [--quick]

1. correctness: ``pallas`` (compiled, not interpreted) vs ``reference`` on ragged shapes, fp32
   (1e-5 relative, matmuls at full precision) and bf16 (1e-2 on gradients);
2. speed: forward+backward of ``pallas`` and ``xla`` vs one plain ``h @ w`` of the same size
   (the kernel does five matmul-equivalents: 1 forward, 2 for dh, 2 for dw).

Prints one JSON object. CI never runs this; it needs the hardware.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from trainer_jax.kernels.linear_logsumexp.api import linear_logsumexp


def _grads(impl: str, h, w, g, t):
    def loss(h, w):
        lse, ent = linear_logsumexp(h, w, temperature=t, impl=impl)
        return jnp.sum(g * lse), (lse, ent)

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


def _max_rel(a, b, weight=None) -> float:
    """max |a - b| / max |b| in float64; ``weight`` (broadcast) zeroes entries out of the check."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if weight is not None:
        a, b = a * weight, b * weight
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _time(fn, *args, reps: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small timing size")
    args = ap.parse_args()
    report: dict = {"backend": jax.default_backend(), "devices": str(jax.devices())}
    key = jax.random.key(0)

    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
        n, d, v = 1000, 512, 32768 + 100  # ragged N and V
        k1, k2, k3 = jax.random.split(key, 3)
        h = (jax.random.normal(k1, (n, d)) / np.sqrt(d)).astype(dtype)
        w = jax.random.normal(k2, (d, v)).astype(dtype)
        g = jax.random.normal(k3, (n,))
        with jax.default_matmul_precision("highest"):
            (rdh, rdw), (rl, re) = _grads(
                "reference", h.astype(jnp.float32), w.astype(jnp.float32), g, 0.8
            )(h.astype(jnp.float32), w.astype(jnp.float32))
        (dh, dw), (lse, ent) = _grads("pallas", h, w, g, 0.8)(h, w)
        errs = {
            "lse": _max_rel(lse, rl),
            "entropy": _max_rel(ent, re),
            "dh": _max_rel(dh, rdh),
            "dw": _max_rel(dw, rdw),
        }
        report[f"correctness_{jnp.dtype(dtype).name}"] = {
            "shape": [n, d, v],
            "max_rel_err": errs,
            "tol": tol,
            "ok": all(e <= tol for e in errs.values()),
        }

    n, d, v = (2048, 1024, 32768) if args.quick else (8192, 1024, 151936)
    k1, k2, k3 = jax.random.split(key, 3)
    h = (jax.random.normal(k1, (n, d)) / np.sqrt(d)).astype(jnp.bfloat16)
    w = jax.random.normal(k2, (d, v)).astype(jnp.bfloat16)
    g = jax.random.normal(k3, (n,))
    matmul = jax.jit(lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32))
    t_mm = _time(matmul, h, w)
    timing = {"shape": [n, d, v], "dtype": "bfloat16", "matmul_s": t_mm}
    for impl in ("pallas", "xla"):
        try:
            t = _time(_grads(impl, h, w, g, 1.0), h, w)
            timing[f"{impl}_fwd_bwd_s"] = t
            timing[f"{impl}_over_matmul"] = t / t_mm
        except Exception as e:  # report, don't hide, a failure on the hardware
            timing[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:2000]
    report["timing"] = timing
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
