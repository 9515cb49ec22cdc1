"""Per-device memory of one train step at the Qwen3-0.6B shape: remat none vs full, 1 vs 8 devices.

Compile only: the policy is never allocated (``Learner.compile_abstract`` traces it under
``nnx.eval_shape``), and XLA's memory analysis of the compiled SPMD step gives, per device, the
temporary memory (activations kept for the backward pass, gradients, kernel scratch) and the
argument bytes (parameters + AdamW state + the batch's shard). For rows of 4,096 and 16,384
tokens (4 rows; half of each row's tokens are policy tokens) it compares rematerialisation per
decoder layer ``none`` vs ``full`` and one device vs a (4 fsdp x 2 tensor) mesh of 8, all in the
same run. Targets (issue 17): full remat needs >= 4x less temporary memory than none at 16,384
tokens; per-device parameters + optimizer state on 8 devices <= 1/6 of one device. The other
memory knob, ``train.micro_rows`` (rows through the model one at a time), is measured beside them.

    .venv/bin/python benchmarks/bench_train_memory.py [--quick] [--out PATH]
        [--remat none,full] [--reuse OLD.json]
    .venv/bin/python benchmarks/bench_train_memory.py --long [--reuse OLD.json[,MORE.json]]
        [--long-only ROWxCONTEXT[xFORM],... | none]

``--long`` (issue 33, context parallelism): one row of 65,536 / 131,072 / 262,144 tokens, full
remat, on ``context`` 1 (one device), 4 and 8 (a mesh of that many devices; the weights and AdamW
state split over ``context`` too, ``mesh.rules: {embed: [fsdp, context]}``), attention in the
ring form (``mesh.context_attention: ring``, the default) and, at 262,144 tokens, the all-gather
form beside it (``--long-only 262144x8xring,32768x1`` measures just those rows, keeping the rest
from ``--reuse``),
plus one 32,768-token row on one device (the goal: context 8 at 262,144 tokens needs no more per
device than that), and a projection of the longest row per device for Qwen3-8B and
Qwen3-30B-A3B on 80 GB cards (``project``). Every row of the JSON carries one integer field per
mesh axis and ``row_len``.

(default PATH: benchmarks/results/bench_train_memory.json; ``--quick``: 2 layers and rows of
512 tokens, to check the script). Compiling the unrolled 28-layer ``none`` step takes minutes to a
quarter of an hour on a loaded 2-core machine; ``--remat full --reuse OLD.json`` measures only
the ``full`` rows and copies the others from an earlier run (marked ``reused_from``), valid while
the ``none`` program has not changed. The devices are XLA's host-platform fakes, so the figures are
the CPU backend's; accelerator backends lay out memory differently, the ratios carry over.
"""

from __future__ import annotations

import os
import sys

if "jax" in sys.modules:
    raise RuntimeError("run this as a script: it must set XLA_FLAGS before JAX starts")
_FLAG = "--xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from convert.qwen3_config import Qwen3Config  # noqa: E402
from trainer_jax.learner import Learner, OptimizerConfig  # noqa: E402
from trainer_jax.models import init_model  # noqa: E402
from trainer_jax.objective import ObjectiveConfig  # noqa: E402
from trainer_jax.parallel import ShardingRules, make_mesh  # noqa: E402
from trainer_jax.parallel.check import synthetic_batch  # noqa: E402
from trainer_jax.parallel.memory import compiled_memory  # noqa: E402
from trainer_jax.parallel.mesh import describe  # noqa: E402

QWEN3_06B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
MESHES = {"1 device": None, "4 fsdp x 2 tensor": dict(fsdp=4, tensor=2)}
ROWS = 4


def measure(qcfg: Qwen3Config, row_len: int, remat: str, mesh_axes: dict | None,
            micro_rows: int | None = None, rows: int = ROWS, overrides: dict | None = None,
            context_attention: str = "ring") -> dict:
    if mesh_axes is None:
        mesh = make_mesh(devices=jax.devices()[:1])
    else:  # a mesh of exactly the devices the axes name (context 4: 4 of the 8 devices)
        n = math.prod(v for v in mesh_axes.values() if v > 0)
        mesh = make_mesh(devices=jax.devices()[:n], **{"data": 1, **mesh_axes})
    rules = ShardingRules.for_model(qcfg, overrides)
    inputs, batch = synthetic_batch(qcfg.vocab_size, rows=rows, row_len=row_len,
                                    max_tokens=rows * row_len // 2, head_k=20, support_k=8)
    t0 = time.perf_counter()
    compiled = Learner.compile_abstract(
        lambda: init_model(qcfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, remat=remat),
        OptimizerConfig(), ObjectiveConfig(), mesh, rules, inputs, batch, micro_rows=micro_rows,
        context_attention=context_attention)
    memory = compiled_memory(compiled)
    # The batch's rows are split over the batch axes (replicated over tensor).
    batch_shards = math.prod(mesh.shape[a] for a in ("data", "fsdp", "expert"))
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves((inputs, batch))) // batch_shards
    return {"row_len": row_len, "rows": rows, "remat": remat, "micro_rows": micro_rows,
            **({"rules": overrides} if overrides else {}),
            **({"context_attention": context_attention} if mesh.shape["context"] > 1 else {}),
            "mesh": describe(mesh), **{a: int(mesh.shape[a]) for a in mesh.axis_names},
            "devices": mesh.size,
            "compile_s": round(time.perf_counter() - t0, 1), "xla": memory,
            "temp_bytes_per_device": memory["temp_size_bytes"],
            "state_bytes_per_device": memory["argument_size_bytes"] - batch_bytes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 layers, rows of 512 tokens")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_train_memory.json"))
    p.add_argument("--remat", default="none,full", help="remat modes to measure (comma-separated)")
    p.add_argument("--reuse", default=None,
                   help="an earlier JSON: its rows for modes not measured now are copied (--long: "
                        "several, comma-separated)")
    p.add_argument("--long", action="store_true",
                   help="one long row (65,536-262,144 tokens) over context 1 / 4 / 8, full remat")
    p.add_argument("--long-only", default=None,
                   help="with --long: only these rows, e.g. 262144x8xring,32768x1 (the rest reused; "
                        "'none': measure nothing, merge --reuse A.json,B.json and summarise)")
    args = p.parse_args(argv)
    if args.long:
        return long_rows(args, argv)
    shape = dict(QWEN3_06B, num_hidden_layers=2) if args.quick else QWEN3_06B
    qcfg = Qwen3Config(**shape)
    lengths = (256, 512) if args.quick else (4096, 16384)
    remats = args.remat.split(",")
    rows = []
    if args.reuse:
        old = json.loads(Path(args.reuse).read_text())
        if old["model"] != shape:
            raise SystemExit(f"{args.reuse} is of another model shape")
        rows = [dict(r, reused_from=old.get("measured", args.reuse)) for r in old["results"]
                if r["remat"] not in remats and r["row_len"] in lengths]
    for row_len in lengths:
        for remat in remats:
            for name, axes in MESHES.items():
                r = measure(qcfg, row_len, remat, axes)
                rows.append(r)
                print(f"{row_len:>6} tokens  remat={remat:<4}  {name:<18} temp "
                      f"{r['temp_bytes_per_device'] / 2**20:9.1f} MiB  state "
                      f"{r['state_bytes_per_device'] / 2**20:9.1f} MiB  (compile {r['compile_s']} s)",
                      flush=True)

        if "none" not in remats:
            continue
        # The other memory knob: rows through the model one at a time (train.micro_rows).
        r = measure(qcfg, row_len, "none", None, micro_rows=1)
        rows.append(r)
        print(f"{row_len:>6} tokens  remat=none  micro_rows=1 1 device temp "
              f"{r['temp_bytes_per_device'] / 2**20:9.1f} MiB  (compile {r['compile_s']} s)", flush=True)

    def pick(row_len, remat, devices, micro_rows=None):
        key = (row_len, remat, devices, micro_rows)
        return next((r for r in rows if (r["row_len"], r["remat"], r["devices"],
                                         r.get("micro_rows")) == key), None)

    longest = lengths[-1]
    temp, state = "temp_bytes_per_device", "state_bytes_per_device"
    remat_ratio = pick(longest, "none", 1)[temp] / pick(longest, "full", 1)[temp]
    state_ratio = pick(longest, "full", 8)[state] / pick(longest, "full", 1)[state]
    micro = pick(longest, "none", 1, 1)
    micro_ratio = pick(longest, "none", 1)[temp] / micro[temp] if micro else None
    summary = {
        "remat_temp_ratio_none_over_full": round(remat_ratio, 2),
        "micro_rows_temp_ratio_all_over_one": micro_ratio and round(micro_ratio, 2),
        "remat_target_met": remat_ratio >= 4.0,
        "state_per_device_8_over_1": round(state_ratio, 4),
        "state_target_met": state_ratio <= 1 / 6,
        "row_len": longest,
        "temp_gib_1_device": {remat: round(pick(longest, remat, 1)[temp] / 2**30, 1)
                              for remat in ("none", "full")},
    }
    print(json.dumps(summary, indent=2))
    result = {"benchmark": "bench_train_memory", "command": " ".join(["benchmarks/bench_train_memory.py",
                                                                      *(argv or sys.argv[1:])]),
              "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "model": shape, "rows": ROWS, "quick": args.quick,
              "commit": _commit(), "jax": jax.__version__, "machine": platform.machine(),
              "results": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


LONG_LENGTHS = (65_536, 131_072, 262_144)
ZERO_OVER_CONTEXT = {"embed": ["fsdp", "context"]}
CONTEXTS = (1, 4, 8)
BASELINE_LEN = 32_768  # the goal: context 8 at 262,144 tokens within one such row on one device
# Shapes for the projection (HF configs): layers, hidden, MLP / expert width, heads, KV heads,
# head_dim, vocabulary, parameters (B), experts (active).
PROJECT = {
    "Qwen3-8B": dict(layers=36, hidden=4096, mlp=12288, kv=8 * 128, vocab=151_936, params_b=8.19),
    "Qwen3-30B-A3B": dict(layers=48, hidden=2048, mlp=8 * 768, kv=4 * 128, vocab=151_936, params_b=30.5),
}
SHAPE_06B = dict(layers=28, hidden=1024, mlp=3072, kv=8 * 128, vocab=151_936, params_b=0.6)


def long_rows(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The ``--long`` measurement (module docstring); rows appended to ``--reuse``'s, if given.

    An earlier ``--long`` row in ``--reuse`` is kept (marked ``reused_from``) until this run
    measures it again, so a run cut short still leaves the whole grid (the JSON names which rows
    are fresh). Rows from before ring attention carry no ``context_attention``: all-gather."""
    qcfg = Qwen3Config(**QWEN3_06B)
    rows: list[dict] = []
    old: dict = {}
    long_old: dict[tuple, dict] = {}
    merge = args.long_only == "none"
    for n, path in enumerate(args.reuse.split(",") if args.reuse else []):
        # The first file gives the other rows; each file's long rows replace earlier files'
        # (a fresh row is never replaced by a reused one), so the rows of runs made side by side
        # merge: --long-only none --reuse A.json,B.json keeps each file's fresh rows fresh.
        earlier = json.loads(Path(path).read_text())
        old = old or earlier
        for r in earlier["results"]:
            axes = dict(kv.split("=") for kv in r["mesh"].split())
            r = {**r, **{a: int(axes.get(a, 1)) for a in ("data", "fsdp", "expert", "context", "tensor")},
                 "rows": r.get("rows", ROWS)}
            if r["rows"] == 1:  # an earlier --long row: kept until measured again now
                if r["context"] > 1:
                    r.setdefault("context_attention", "all_gather")
                run = f"{path} ({earlier.get('measured_long')} on {earlier.get('commit_long')})"
                if merge and "reused_from" not in r:
                    r.setdefault("run", run)
                else:
                    r.setdefault("reused_from", run)
                kept = long_old.get(_long_key(r))
                if not (kept and "reused_from" in r and "reused_from" not in kept):
                    long_old[_long_key(r)] = r
            elif n == 0:
                rows.append(r)
    # The goal's rows and the fit's first; the JSON is rewritten after every row, so a run cut
    # short keeps what it measured (the summary then covers what is there).
    t_max = LONG_LENGTHS[-1]
    plan = [(t_max, 8, "ring"), (BASELINE_LEN, 1, None), (t_max, 8, "all_gather"), (t_max, 4, "ring"),
            (LONG_LENGTHS[0], 8, "ring"), (t_max, 4, "all_gather"), (LONG_LENGTHS[1], 8, "ring"),
            (LONG_LENGTHS[1], 4, "ring"), (LONG_LENGTHS[0], 4, "ring"), (t_max, 1, None),
            (LONG_LENGTHS[1], 1, None), (LONG_LENGTHS[0], 1, None)]
    if merge:
        plan = []
    elif args.long_only:  # ROWxCONTEXT[xFORM], FORM ring (the default) or all_gather
        plan = []
        for item in args.long_only.split(","):
            t_, c_, *form = item.split("x")
            plan.append((int(t_), int(c_), (form or ["ring"])[0] if int(c_) > 1 else None))

    def write() -> dict:
        long = list(long_old.values())
        summary = {**old.get("summary", {}), **context_summary(long)}
        result = {**old, "benchmark": "bench_train_memory",
                  "command": " ".join(["benchmarks/bench_train_memory.py", *(argv or sys.argv[1:])]),
                  "measured_long": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "model": QWEN3_06B, "commit_long": _commit(), "jax": jax.__version__,
                  "machine": platform.machine(), "results": rows + long, "summary": summary}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return summary

    for row_len, context, form in plan:
        # Context meshes also split the weights and AdamW state over context (ZeRO, as FSDP does).
        r = measure(qcfg, row_len, "full", None if context == 1 else dict(context=context), rows=1,
                    overrides=None if context == 1 else ZERO_OVER_CONTEXT, context_attention=form or "ring")
        long_old[_long_key(r)] = r
        print(f"{row_len:>7} tokens  1 row  context {context} {form or '':<10}  temp "
              f"{r['temp_bytes_per_device'] / 2**30:7.2f} GiB  state "
              f"{r['state_bytes_per_device'] / 2**30:6.2f} GiB  (compile {r['compile_s']} s)", flush=True)
        write()  # after every row: a run cut short keeps what it measured
    summary = write()
    print(json.dumps({k: summary.get(k) for k in ("context_goal", "context_fit_06b", "projection_80gb")},
                     indent=2))
    return 0


def _long_key(r: dict) -> tuple:
    return r["row_len"], r["context"], r.get("context_attention") if r["context"] > 1 else None


def context_summary(long: list[dict]) -> dict:
    """The goal, the per-token slope of temporaries over a device's share of the row, and the
    projection for the larger shapes; all from the ring form (the default) and the one-device
    rows, with the all-gather form's figures beside them. What the rows there are cannot give
    is ``None`` (never an earlier run's figure of another form)."""
    temp = {(r["row_len"], r["context"]): r["temp_bytes_per_device"] for r in long
            if r.get("context_attention", "ring") == "ring"}
    gathered = {(r["row_len"], r["context"]): r["temp_bytes_per_device"] for r in long
                if r.get("context_attention") == "all_gather"}
    t = LONG_LENGTHS[-1]
    gib = lambda table: {f"{t_} x context {c}": round(v / 2**30, 2) for (t_, c), v in sorted(table.items())}
    out: dict = {"context_temp_gib": gib(temp), "context_temp_gib_all_gather": gib(gathered),
                 "context_goal": None, "context_fit_06b": None, "projection_80gb": None}
    if (BASELINE_LEN, 1) in temp and (t, 8) in temp:
        base, goal = temp[(BASELINE_LEN, 1)], temp[(t, 8)]
        out["context_goal"] = {
            "temp_gib_262144_context_8": round(goal / 2**30, 2),
            "temp_gib_32768_one_device": round(base / 2**30, 2), "met": goal <= base,
            "context_attention": "ring",
            **({"temp_gib_262144_context_8_all_gather": round(gathered[(t, 8)] / 2**30, 2)}
               if (t, 8) in gathered else {})}
    if all(key in temp for key in ((t, 8), (t, 4), (LONG_LENGTHS[0], 8))):
        # temp(T, C) ~ fixed + slope * T / C + kv * T: fitted on context 8 and 4 at the longest row.
        slope = (temp[(t, 4)] - temp[(t, 8)]) / (t / 4 - t / 8)
        kv = max(0.0, (temp[(t, 8)] - temp[(LONG_LENGTHS[0], 8)] - slope * (t - LONG_LENGTHS[0]) / 8)
                 / (t - LONG_LENGTHS[0]))
        fixed = temp[(t, 8)] - slope * t / 8 - kv * t
        out["context_fit_06b"] = {"fixed_gib": round(fixed / 2**30, 2),
                                  "bytes_per_device_token": round(slope), "kv_bytes_per_row_token": round(kv)}
        out["projection_80gb"] = {name: project(shape, fixed, slope, kv) for name, shape in PROJECT.items()}
    return out


def project(shape: dict, fixed: float, slope: float, kv: float, card: float = 80e9) -> dict:
    """Longest row per device of 80 GB for a larger shape, from the 0.6B fit: the per-token slope
    scales with layers x hidden (the residual stream saved per layer under full remat) plus one
    layer's MLP width, the K/V term with the K/V width, the fixed part with vocab x hidden (the
    head and embedding gradients); the state (fp32 parameters + AdamW, 16 bytes per parameter)
    split over the 8 devices of the host (``fsdp``, or ``mesh.rules: {embed: [fsdp, context]}`` on
    a context-8 mesh). An extrapolation, not a measurement."""
    ref, s = SHAPE_06B, shape
    per_token = slope * (s["layers"] * s["hidden"] + s["mlp"]) / (ref["layers"] * ref["hidden"] + ref["mlp"])
    per_row_token = kv * s["kv"] / ref["kv"]
    fixed_s = fixed * (s["vocab"] * s["hidden"]) / (ref["vocab"] * ref["hidden"])
    state = 16 * s["params_b"] * 1e9 / 8
    free = card - state - fixed_s
    out = {"state_gb_per_device_fsdp8": round(state / 1e9, 1)}
    for c in (1, 8):
        tokens = free / (per_token / c + per_row_token) if free > 0 else 0
        out[f"max_row_tokens_context_{c}"] = int(tokens)
    return out


def _commit() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes), so figures name their code."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


if __name__ == "__main__":
    raise SystemExit(main())
