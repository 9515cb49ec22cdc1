"""Forward+backward of the full corrected objective with each linear-log-sum-exp implementation.

For every kernel ``impl`` (reference / xla / pallas) this compiles
``value_and_grad(policy_loss, argnums=(hidden, lm_head))`` (MIS + score centering + top-p replay,
top-K head of 20, half the tokens truncated with a kept set of up to 32 ids), reads XLA's compiled
memory analysis (temporary buffers: what the computation needs beyond its inputs and outputs) and
times the compiled executable on this CPU, then reports ratios to ``reference``. ``pallas_gpu_tiles``
is the Pallas objective compiled with the kernel's GPU tile sizes instead of the interpreter's
(memory only). If ``tokamax`` is importable, ``tokamax.linear_softmax_cross_entropy_loss``
(``chunked_xla`` where the installed version has it, else its plain ``xla``) is measured as a peer:
a plain cross-entropy, i.e. the same lse + one gathered logit, without the head terms.

Timing runs the impls round-robin (same background load for each; the 2 cores are shared) and
reports the fastest run as ``time_s`` and every run in ``times_s``.

float32 inputs throughout: XLA:CPU upcasts bf16 matmul operands and hoists a full f32 copy of w out
of the vocabulary loop, which would hide the kernels' own footprint (issue 3). On GPU/TPU bf16 is
native.

Sizes: ``quick`` (default; N=2048, D=256, V=32,003, ragged) and ``large`` (N=8192, D=1024,
V=151,936, Qwen3's vocabulary). At ``large`` memory is analysed at N=8192 for every impl (the
reference's executable needs ~5 GB of logits: it is compiled, not run, at that N) and wall time is
measured on the first ``--time-tokens`` (default 512) tokens at the full D and V: one forward+
backward at N=8192 takes several minutes per impl on 2 shared cores, and every matmul is
N x D x V, so the time ratios carry over. Any run whose estimated peak exceeds 60 % of the memory
available at that moment is skipped with the reason. The Pallas interpreter (the only way to run
Pallas on CPU) is too slow to time at ``large``: only its compiled memory is reported.

    .venv/bin/python benchmarks/bench_loss.py [--size quick|large|all] [--time-tokens N]
        [--repeats R] [--compile-only] [--out benchmarks/results/bench_loss.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainer_jax.kernels.linear_logsumexp import IMPL_NAMES
from trainer_jax.kernels.linear_logsumexp.pallas_gpu import DEFAULT_BLOCKS as GPU_BLOCKS
from trainer_jax.objective import ObjectiveConfig, TokenBatch, policy_loss

SIZES: dict[str, dict[str, int]] = {
    "quick": dict(n=2048, d=256, v=32_003, k=20, s=32),
    "large": dict(n=8192, d=1024, v=151_936, k=20, s=32),
}
IMPLS = IMPL_NAMES
# Only run an executable whose estimated peak is below this share of MemAvailable.
FIT_FRACTION = 0.6
# Pallas runs interpreted on CPU: time it only up to this many N*D*V multiply-adds.
PALLAS_TIME_MAX_MACS = 2 * 2048 * 256 * 32_003
# Tokens timed at the large size (memory is always analysed at the full N).
LARGE_TIME_TOKENS = 512


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def make_inputs(n: int, d: int, v: int, k: int, s: int, seed: int = 0):
    """Random f32 hidden/lm_head and a consistent-looking behaviour batch (values only matter
    for realism, not for the timing: the loss does the same work for any values)."""
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    lm_head = jnp.asarray(rng.normal(size=(d, v), scale=1.0 / np.sqrt(d)), jnp.float32)
    head_ids = np.stack([rng.choice(v, k, replace=False) for _ in range(n)])
    head_lp = np.log(np.sort(rng.dirichlet(np.ones(4 * k), size=n)[:, :k], axis=1)[:, ::-1])
    trunc = rng.uniform(size=n) < 0.5
    sizes = rng.integers(1, s + 1, size=n)
    sup_ids = np.full((n, s), -1, np.int64)
    sup_lp = np.full((n, s), -np.inf)
    tok = rng.integers(0, v, size=n)
    logb = np.log(rng.uniform(0.01, 0.9, size=n))
    for i in np.nonzero(trunc)[0]:
        m = sizes[i]
        sup_ids[i, :m] = head_ids[i, :m] if m <= k else rng.choice(v, m, replace=False)
        lp = rng.normal(size=m)
        sup_lp[i, :m] = lp - np.log(np.exp(lp).sum())
        tok[i] = sup_ids[i, 0]
        logb[i] = sup_lp[i, 0]
    batch = TokenBatch.create(
        token_ids=tok,
        behavior_logprob=logb,
        head_ids=head_ids,
        head_logprobs=head_lp,
        support_ids=sup_ids,
        support_logprobs=sup_lp,
        advantages=rng.normal(size=n),
        loss_mask=(rng.uniform(size=n) > 0.05).astype(np.float32),
        seq_ids=np.arange(n) // 256,
        temperature=1.0,
        group_ids=rng.integers(0, 4, size=n),
    )
    return hidden, lm_head, batch


def device_tiles() -> tuple[tuple[str, int], ...]:
    """The Pallas kernel's own default tiles for GPU ("loop" layout), not the interpreter's."""
    return GPU_BLOCKS.as_options()


def objective_step(impl: str, options: tuple[tuple[str, Any], ...] = ()):
    cfg = ObjectiveConfig(
        is_mode="mis",
        score_centering=True,
        top_p_replay=True,
        impl=impl,
        kernel_options=options,
        num_groups=4,
    )

    def loss(h: jax.Array, w: jax.Array, batch: TokenBatch) -> jax.Array:
        return policy_loss(h, w, batch, cfg)[0]

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def tokamax_impl() -> str:
    """tokamax's chunked XLA implementation where this version has one, else its plain "xla"."""
    from tokamax._src.ops.linear_softmax_cross_entropy_loss import api  # optional peer

    return "chunked_xla" if "chunked_xla" in api.IMPLEMENTATIONS else "xla"


def tokamax_step():
    import tokamax  # optional peer
    from absl import flags

    # tokamax reads absl flags; this script's own argv is not theirs to parse.
    flags.FLAGS.mark_as_parsed()
    impl = tokamax_impl()

    def loss(h: jax.Array, w: jax.Array, batch: TokenBatch) -> jax.Array:
        return tokamax.linear_softmax_cross_entropy_loss(
            h, batch.token_ids, w, reduction="mean", implementation=impl
        )

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def memory(compiled: Any) -> dict[str, int]:
    ma = compiled.memory_analysis()
    out = {
        "temp_bytes": int(ma.temp_size_in_bytes),
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
    }
    out["peak_estimate_bytes"] = (
        out["temp_bytes"] + out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
    )
    return out


def first_rows(batch: TokenBatch, n: int) -> TokenBatch:
    return jax.tree.map(lambda x: x[:n], batch)


def bench_size(name: str, repeats: int, run: bool = True, time_tokens: int | None = None) -> dict[str, Any]:
    dims = SIZES[name]
    h, w, batch = make_inputs(**dims)
    args = (h, w, batch)
    large = name == "large"
    # Timing every token at the large size takes minutes per impl on 2 cores; all matmuls are
    # N x D x V, so time scales linearly in N and a token slice at full D and V keeps the ratios.
    n_time = min(dims["n"], time_tokens or (LARGE_TIME_TOKENS if large else dims["n"]))
    t_args = args if n_time == dims["n"] else (h[:n_time], w, first_rows(batch, n_time))
    macs = n_time * dims["d"] * dims["v"]
    steps: dict[str, Any] = {impl: (lambda impl=impl: objective_step(impl)) for impl in IMPLS}
    # The interpreter's default Pallas tiles are sized for CPU speed; with the tiles the kernel
    # uses on GPU the compiled footprint is the kernel's own (memory only: tiny tiles interpret
    # slowly).
    tiles = device_tiles()
    steps["pallas_gpu_tiles"] = lambda: objective_step("pallas", tiles)
    if importlib.util.find_spec("tokamax") is not None:
        steps[f"tokamax_{tokamax_impl()}"] = tokamax_step
    rounds = 2 if large else repeats
    result: dict[str, Any] = {
        "dims": dims,
        "memory_tokens": dims["n"],
        "time_tokens": n_time,
        "timing": (
            f"{rounds} round-robin rounds over the impls"
            + ("" if large else " after one warm-up each")
            + "; time_s = fastest run (the 2 cores are shared: the minimum is the least"
            " contended estimate), times_s = every run; compile excluded"
        ),
        "impls": {},
    }
    timed: dict[str, Any] = {}
    for impl, make in steps.items():
        entry: dict[str, Any] = {}
        result["impls"][impl] = entry
        t0 = time.perf_counter()
        try:
            compiled = make().lower(*args).compile()
        except Exception as e:  # noqa: BLE001  (report, keep measuring the others)
            entry["error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"[{name}] {impl}: compile failed: {entry['error']}", flush=True)
            continue
        entry["compile_s"] = round(time.perf_counter() - t0, 2)
        entry["memory"] = memory(compiled)
        need = entry["memory"]["peak_estimate_bytes"]
        if impl == "pallas_gpu_tiles":
            entry["kernel_options"] = dict(tiles)
        if not run:
            entry["timing_skipped"] = "--compile-only"
        elif impl == "pallas_gpu_tiles":
            entry["timing_skipped"] = "memory only: the interpreter is slow with small tiles"
        elif impl == "pallas" and macs > PALLAS_TIME_MAX_MACS:
            entry["timing_skipped"] = "Pallas interpreter on CPU is too slow at this size"
        elif t_args is args and need > FIT_FRACTION * mem_available():
            entry["timing_skipped"] = (
                f"estimated peak {need / 2**30:.1f} GiB > {FIT_FRACTION} x available "
                f"{mem_available() / 2**30:.1f} GiB"
            )
        elif t_args is args:
            timed[impl] = compiled
        else:
            timed[impl] = make().lower(*t_args).compile()
            entry["time_memory"] = memory(timed[impl])
        del compiled
        print(f"[{name}] {impl}: {json.dumps(entry)}", flush=True)

    # Round-robin so that every impl sees the same background load.
    for impl, compiled in timed.items():
        need = result["impls"][impl].get("time_memory", result["impls"][impl]["memory"])
        if need["peak_estimate_bytes"] > FIT_FRACTION * mem_available():
            result["impls"][impl]["timing_skipped"] = "does not fit in the memory available now"
            continue
        if not large:
            jax.block_until_ready(compiled(*t_args))
        result["impls"][impl]["times_s"] = []
    for _ in range(rounds):
        for impl, compiled in timed.items():
            entry = result["impls"][impl]
            if "times_s" not in entry:
                continue
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*t_args))
            entry["times_s"].append(round(time.perf_counter() - t0, 4))
    for impl in timed:
        entry = result["impls"][impl]
        if entry.get("times_s"):
            entry["time_s"] = min(entry["times_s"])
            entry["tokens_per_s"] = round(n_time / entry["time_s"], 1)
            print(f"[{name}] {impl}: times {entry['times_s']}", flush=True)
    timed.clear()
    ref = result["impls"].get("reference", {})
    for entry in result["impls"].values():
        if "memory" in entry and "memory" in ref:
            entry["temp_ratio_to_reference"] = round(
                entry["memory"]["temp_bytes"] / max(ref["memory"]["temp_bytes"], 1), 5
            )
            entry["temp_reduction_vs_reference"] = round(
                ref["memory"]["temp_bytes"] / max(entry["memory"]["temp_bytes"], 1), 1
            )
        if "time_s" in entry and "time_s" in ref:
            entry["time_ratio_to_reference"] = round(entry["time_s"] / ref["time_s"], 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=[*SIZES, "all"], default="quick")
    ap.add_argument("--quick", action="store_true", help="same as --size quick")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds at the quick size (large: 2)")
    ap.add_argument(
        "--time-tokens",
        type=int,
        default=None,
        help=f"tokens to time (default: all at quick, {LARGE_TIME_TOKENS} at large)",
    )
    ap.add_argument("--compile-only", action="store_true", help="memory analysis, no timing")
    ap.add_argument("--out", default="benchmarks/results/bench_loss.json")
    a = ap.parse_args()
    sizes = ["quick"] if a.quick else list(SIZES) if a.size == "all" else [a.size]
    report: dict[str, Any] = {
        "benchmark": "bench_loss",
        "objective": "policy_loss value_and_grad wrt (hidden, lm_head); mis + SC + replay",
        "dtype": "float32",
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "mem_available_gib_at_start": round(mem_available() / 2**30, 1),
        },
        "tokamax": importlib.util.find_spec("tokamax") is not None,
        "sizes": {},
    }
    for s in sizes:
        report["sizes"][s] = bench_size(s, a.repeats, run=not a.compile_only, time_tokens=a.time_tokens)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
