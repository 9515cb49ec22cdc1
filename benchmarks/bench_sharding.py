"""Per-device parameter + optimizer memory of the sharded trainer vs one device, on 8 CPU devices.

For each model size and mesh, builds a ``Learner`` (parameters and AdamW state created
sharded), compiles its train step for one batch shape and reads XLA's memory analysis of the
per-device SPMD program: ``argument`` bytes are the state shards plus the batch shards, so the
state figure is ``argument - batch``; it is cross-checked against the sum of the arrays' own
shard sizes. The baseline is the same step on a one-device mesh, in the same run. The issue's
bar: (2 fsdp x 4 tensor) holds at most 1/6 of the single-device state per device.

    .venv/bin/python benchmarks/bench_sharding.py [--quick] [--time N] [--out PATH]

(default PATH: benchmarks/results/bench_sharding.json).

The devices are XLA's host-platform fakes (``--xla_force_host_platform_device_count=8``), so
memory figures are exact but step times (``--time``) only show that the program runs.
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
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from convert.qwen3_config import Qwen3Config  # noqa: E402
from trainer_jax.learner import Learner, OptimizerConfig  # noqa: E402
from trainer_jax.objective import ObjectiveConfig  # noqa: E402
from trainer_jax.parallel import make_mesh  # noqa: E402
from trainer_jax.parallel.check import synthetic_batch  # noqa: E402
from trainer_jax.parallel.memory import compiled_memory, max_device_bytes, state_memory_report  # noqa: E402
from trainer_jax.parallel.mesh import describe  # noqa: E402

SIZES = {  # bench_forward's sizes
    "dense": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False),
    "moe": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False),
}
MESHES = {
    "single": None,
    "8data": dict(data=8),
    "8fsdp": dict(fsdp=8),
    "2fsdp_4tensor": dict(fsdp=2, tensor=4),
    "2data_2fsdp_2expert": dict(data=2, fsdp=2, expert=2),
}
QUICK = {"dense": ["single", "2fsdp_4tensor"], "moe": ["single", "2fsdp_4tensor", "2data_2fsdp_2expert"]}


def bench_one(kind: str, mesh_name: str, *, rows: int, row_len: int, time_steps: int) -> dict:
    cfg = Qwen3Config(**SIZES[kind])
    axes = MESHES[mesh_name]
    mesh = make_mesh(devices=jax.devices()[:1]) if axes is None else make_mesh(**axes)
    learner = Learner.create(cfg, OptimizerConfig(), ObjectiveConfig(), mesh, seed=0)
    inputs, batch = synthetic_batch(cfg.vocab_size, rows=rows, row_len=row_len,
                                    max_tokens=rows * row_len // 2, head_k=20, support_k=8)
    t0 = time.perf_counter()
    compiled = learner.compile_step(inputs, batch)
    compile_s = time.perf_counter() - t0
    xla = compiled_memory(compiled)
    batch_bytes = max_device_bytes(learner.place(inputs, batch))
    arrays = state_memory_report(learner.model, learner.optimizer)
    out = {
        "mesh": describe(mesh), "devices": mesh.size,
        "state_bytes_per_device_xla": xla["argument_size_bytes"] - batch_bytes,
        "state_bytes_per_device_arrays": arrays["state_bytes_per_device"],
        "params_bytes_per_device": arrays["params_bytes_per_device"],
        "optimizer_bytes_per_device": arrays["optimizer_bytes_per_device"],
        "state_bytes_total": arrays["state_bytes_total"],
        "batch_bytes_per_device": batch_bytes, "xla": xla, "compile_s": round(compile_s, 2),
    }
    if time_steps:
        learner.step(inputs, batch)
        times = []
        for _ in range(time_steps):
            t0 = time.perf_counter()
            learner.step(inputs, batch)
            times.append(time.perf_counter() - t0)
        out["step_s"] = round(statistics.median(times), 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer meshes")
    p.add_argument("--time", type=int, default=0, metavar="N", help="also time N steps per mesh")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--row-len", type=int, default=128)
    p.add_argument("--out", default="benchmarks/results/bench_sharding.json")
    args = p.parse_args()
    runs: dict[str, dict] = {}
    for kind in SIZES:
        runs[kind] = {"config": SIZES[kind], "meshes": {}}
        for mesh_name in (QUICK[kind] if args.quick else MESHES):
            r = bench_one(kind, mesh_name, rows=args.rows, row_len=args.row_len, time_steps=args.time)
            runs[kind]["meshes"][mesh_name] = r
            base = runs[kind]["meshes"]["single"]["state_bytes_per_device_xla"]
            r["ratio_vs_single"] = round(r["state_bytes_per_device_xla"] / base, 4)
            mib = lambda key, r=r: r[key] / 2**20
            print(f"{kind:5s} {mesh_name:20s} state/device {mib('state_bytes_per_device_xla'):8.2f} MiB "
                  f"(arrays {mib('state_bytes_per_device_arrays'):8.2f}) ratio {r['ratio_vs_single']:.4f} "
                  f"compile {r['compile_s']:.1f}s", flush=True)
    bar = {kind: runs[kind]["meshes"]["2fsdp_4tensor"]["ratio_vs_single"] for kind in runs}
    result = {
        "benchmark": "per-device parameter + AdamW state bytes (XLA memory analysis), fp32, vs one device",
        "command": "python benchmarks/bench_sharding.py" + (" --quick" if args.quick else ""),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                    "devices": f"{jax.device_count()} x {jax.devices()[0].platform} (host-platform fakes)"},
        "batch": {"rows": args.rows, "row_len": args.row_len},
        "acceptance": {"mesh": "2fsdp_4tensor", "ratio_vs_single": bar, "limit": round(1 / 6, 4),
                       "ok": all(r <= 1 / 6 for r in bar.values())},
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["acceptance"]))


if __name__ == "__main__":
    main()
