"""The device check's kernel part: every fused candidate ``auto`` may pick here, against the
reference, recorded in the checked-kernel registry (``trainer_jax/kernels/checked.py``).

    python scripts/device_check.py kernels [--tiny] [--registry PATH]

Candidates (``checked.CANDIDATES``): the Pallas linear log-sum-exp (``pallas`` vs ``reference``,
forward and both gradients) on GPU and TPU; attention on packed rows with padding, forward and
dq/dk/dv, against ``reference`` in fp32: ``pallas_gpu`` and ``cudnn`` on GPU, ``splash`` on TPU.
On a CPU (``--tiny``, the test suite) the Pallas kernels run interpreted and are recorded as
``tiny`` entries, which never enable a kernel.

Tolerances, stated per entry: inputs are bf16 and the oracle is fp32 at full matmul precision, so
errors are bf16 rounding. Error = max |kernel - reference| / max |reference| over outputs and
gradients (padding positions excluded). The loss kernel must be within ``LSE_TOL``; an attention
kernel within ``max(ATTENTION_TOL, 1.5 x the error of blocked``, the XLA path auto falls back to,
on the same inputs): no worse than what runs without it. Each candidate's forward+backward time
and the fallback's are recorded too: ``auto`` refuses a kernel that was slower than its fallback.
"""

from __future__ import annotations

import importlib.metadata

LSE_TOL = 2e-2
ATTENTION_TOL = 2e-2


def versions() -> dict[str, str]:
    """jax / jaxlib / torch as installed (torch by metadata: this process must not import it)."""
    import jax
    import jaxlib

    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "absent"
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "torch": torch}


def _max_rel(a, b, weight=None) -> float:
    from trainer_jax.kernels.linear_logsumexp.device_check import _max_rel as max_rel

    return max_rel(a, b, weight)


def _time(fn, *args, reps: int = 5) -> float:
    from trainer_jax.kernels.linear_logsumexp.device_check import _time as best_time

    return best_time(fn, *args, reps=reps)


def packed_segments(rows: int, t: int, seed: int = 0):
    """Rows of contiguous sequences of mixed lengths, the last ending in padding (segment 0)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = [1, 3, t // 16, t // 5, t // 3]
    seg = np.zeros((rows, t), np.int32)
    for r in range(rows):
        pos, sid = 0, 1
        while pos < t - t // 8:
            n = int(rng.choice(lengths))
            seg[r, pos:pos + n] = sid
            pos, sid = pos + n, sid + 1
    return seg


def attention_check(tiny: bool) -> tuple[dict, list[tuple[str, bool, float | None, float, dict]]]:
    """(report, results): each candidate's errors and times; results are (kernel, passed,
    max_err, tolerance, extra) for the registry."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from trainer_jax.kernels import checked
    from trainer_jax.models.attention import CPU_BLOCK, attention

    where = checked.here()
    candidates = checked.CANDIDATES["attention"].get(where.platform, ())
    interpret = where.platform == "cpu"
    if interpret:  # no fused kernel runs natively on a CPU: the Pallas GPU kernel, interpreted
        candidates = ("pallas_gpu",)
    b, t, h, kh, hd = (2, 64, 4, 2, 16) if tiny else (4, 4096, 16, 8, 128)
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(k1, (b, t, h, hd), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(k2, (b, t, kh, hd), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(k3, (b, t, kh, hd), jnp.float32).astype(jnp.bfloat16)
    cot = jax.random.normal(k4, (b, t, h, hd), jnp.float32)
    seg = jnp.asarray(packed_segments(b, t))
    real = np.asarray(seg > 0, np.float64)[:, :, None, None]  # padding outputs are unspecified

    def fwd_bwd(impl: str, **options):
        def loss(q, k, v):
            out = attention(q, k, v, seg, impl=impl, **options)
            return jnp.sum(out.astype(jnp.float32) * cot * (seg > 0)[:, :, None, None]), out
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))

    def errors(got, want) -> dict[str, float]:
        (dq, dk, dv), out = got
        (rq, rk, rv), rout = want
        return {"out": _max_rel(out, rout, real), "dq": _max_rel(dq, rq, real),
                "dk": _max_rel(dk, rk), "dv": _max_rel(dv, rv)}

    with jax.default_matmul_precision("highest"):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        want = fwd_bwd("reference")(*f32)
    fallback_fn = fwd_bwd("blocked", block=CPU_BLOCK)
    fallback_err = errors(fallback_fn(q, k, v), want)
    fallback_s = _time(fallback_fn, q, k, v)
    tol = max(ATTENTION_TOL, 1.5 * max(fallback_err.values()))
    report: dict = {"shape": {"rows": b, "seq_len": t, "heads": h, "kv_heads": kh, "head_dim": hd},
                    "dtype": "bfloat16 (reference: float32, highest precision)",
                    "segments_per_row": [int(len(set(r.tolist()) - {0})) for r in np.asarray(seg)],
                    "blocked": {"max_rel_err": fallback_err, "fwd_bwd_s": fallback_s},
                    "tolerance": tol}
    results = []
    shape = f"{b} x {t}, {h}/{kh} heads of {hd}, packed, bf16"
    for name in candidates:
        options = {"interpret": True} if interpret else {}
        try:
            fn = fwd_bwd(name, **options)
            err = errors(fn(q, k, v), want)
            seconds = _time(fn, q, k, v, reps=2 if interpret else 5)
            worst = max(err.values())
            ok = bool(np.isfinite(worst) and worst <= tol)
            report[name] = {"max_rel_err": err, "fwd_bwd_s": seconds, "pass": ok}
            results.append((f"attention:{name}", ok, worst, tol,
                            {"shape": shape, "fwd_bwd_s": seconds, "fallback_s": fallback_s,
                             "errors": err}))
        except Exception as e:  # a kernel that does not run here is a failed check, recorded
            msg = f"{type(e).__name__}: {e}"[:500]
            report[name] = {"error": msg, "pass": False}
            results.append((f"attention:{name}", False, None, tol, {"shape": shape, "error": msg}))
    return report, results


def lse_check(tiny: bool) -> tuple[dict, list[tuple[str, bool, float | None, float, dict]]]:
    """The Pallas linear log-sum-exp (forward and both gradients) vs ``reference`` in fp32, timed
    against one plain ``h @ w`` and against the ``xla`` kernel auto falls back to."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from trainer_jax.kernels.linear_logsumexp.device_check import _grads

    n, d, v = (64, 32, 300) if tiny else (8192, 1024, 151_936)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    h = (jax.random.normal(k1, (n, d)) / np.sqrt(d)).astype(jnp.bfloat16)
    w = jax.random.normal(k2, (d, v)).astype(jnp.bfloat16)
    g = jax.random.normal(k3, (n,))
    with jax.default_matmul_precision("highest"):
        h32, w32 = h.astype(jnp.float32), w.astype(jnp.float32)
        (rdh, rdw), (rl, _) = _grads("reference", h32, w32, g, 1.0)(h32, w32)
    matmul = jax.jit(lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32))
    xla = _grads("xla", h, w, g, 1.0)
    t_mm, t_xla = _time(matmul, h, w), _time(xla, h, w)
    report: dict = {"shape": [n, d, v], "dtype": "bfloat16", "tolerance": LSE_TOL, "matmul_s": t_mm,
                    "xla_fwd_bwd_s": t_xla,
                    "note": "fwd+bwd is five matmul-equivalents (1 forward, 2 for dh, 2 for dw)"}
    shape = f"{n} x {d} x {v}, bf16"
    try:
        pallas = _grads("pallas", h, w, g, 1.0)
        (dh, dw), (lse, _) = pallas(h, w)
        err = {"lse": _max_rel(lse, rl), "dh": _max_rel(dh, rdh), "dw": _max_rel(dw, rdw)}
        t_pallas = _time(pallas, h, w)
    except Exception as e:  # a kernel that does not run here is a failed check, recorded
        msg = f"{type(e).__name__}: {e}"[:500]
        report["error"] = msg
        return report, [("linear_logsumexp:pallas", False, None, LSE_TOL, {"shape": shape, "error": msg})]
    worst = max(err.values())
    ok = bool(np.isfinite(worst) and worst <= LSE_TOL)
    report.update({"max_rel_err_vs_reference": err, "pass": ok, "pallas_fwd_bwd_s": t_pallas,
                   "pallas_fwd_bwd_over_matmul": t_pallas / t_mm})
    return report, [("linear_logsumexp:pallas", ok, worst, LSE_TOL,
                     {"shape": shape, "fwd_bwd_s": t_pallas, "fallback_s": t_xla, "errors": err})]


def run(tiny: bool, registry: str | None) -> dict:
    """Check every candidate; record each result as soon as it exists (a later crash keeps the
    earlier ones) when ``registry`` names a file; return the report."""
    from trainer_jax.kernels import checked

    where, vers = checked.here(), versions()
    report: dict = {"where": {"platform": where.platform, "device_kind": where.device_kind,
                              "jax_minor": where.jax_minor, **vers},
                    "registry": registry or "not written (--tiny without --registry)"}
    for key, check in (("linear_logsumexp", lse_check), ("attention", attention_check)):
        if not tiny and not checked.CANDIDATES[key].get(where.platform):
            report[key] = {"skipped": f"no fused {key} candidate on {where.platform}"}
            continue
        try:
            report[key], results = check(tiny)
        except Exception as e:  # the reference itself failed: nothing to record
            report[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        entries = [checked.make_entry(kernel, where, passed=ok, max_err=err, tolerance=tol,
                                      versions=vers, tiny=tiny, **extra)
                   for kernel, ok, err, tol, extra in results]
        if registry:
            checked.record(entries, registry)
        report.setdefault("recorded", []).extend(
            f"{e['kernel']}: {e['result']}" + (f" ({e['max_err']:.2g} vs {e['tolerance']:.2g})"
                                               if e["max_err"] is not None else "") for e in entries)
    report["auto"] = [checked.describe_choice(k, "auto", where, registry)
                      for k in ("attention", "linear_logsumexp")]
    return report
