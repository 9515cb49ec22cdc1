"""The quantization-shaped dial on the demo's policy (issue 48 item 2): probe KL and out-of-range
share per ``round_weights`` K, beside the demo's own groups, all in one run.

The policy: ``configs/local_mixed.yaml``'s warm start (``mixrl-train sft --config
configs/local_mixed.yaml``; ``--policy DIR`` takes an existing one, else it is made here). It is
published as version 0 in every format the demo's groups load (calibrated as the demo does:
``kv_scale_floor`` 1.0), with the version probe of ``--prompts`` task prompts x ``--tokens`` tokens
drawn from the trainer's float32 JAX policy at temperature 1 (``trainer_jax.probe.Prober``; the
demo's probe is 4 x 16, more here so the table is not noise). Each row scores the probe's tokens
with the mixrl engine on this CPU (``Engine.score``) and compares with the trainer's log p
(``mixrl_wire.probe.compare``): probe KL = mean k3 of r = q / p, and the out-of-range share = the
probe tokens whose p / q leaves [0.2, 5] (objective ``c_min`` / ``c_max`` defaults).

Rows: the demo's four groups (``bf16``: the baseline, ``fp8``, ``nvfp4_w4a4`` + fp8 KV,
``mxfp4_w4a16`` + fp8 KV), then ``bf16`` with ``round_weights: {bits: K, block_size: B}`` for each K.
The dial's rows run the bf16 engine with a recipe carrying ``round_weights``, so ``load_model``
rounds the projections as it loads them (the field ``mixrl_wire.recipes.Recipe`` is to grow; here
a subclass carries it).

    .venv/bin/python benchmarks/bench_round_weights.py [--policy DIR] [--bits 8 6 5 4 3] \\
        [--block-size 32] [--out benchmarks/results/bench_round_weights.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "local_mixed.yaml"
#: (label, recipe, KV cache dtype, attention, export format): configs/local_mixed.yaml's groups
GROUPS = [("bf16", "bf16", "auto", "auto", "bf16"), ("fp8", "fp8", "auto", "auto", "fp8_block"),
          ("nvfp4", "nvfp4_w4a4", "fp8_e4m3", "auto", "nvfp4"),
          ("mxfp4", "mxfp4_w4a16", "fp8_e4m3", "eager", "mxfp4")]
C_MIN, C_MAX = 0.2, 5.0


def warm_start(out: Path) -> Path:
    """The demo's warm start, written to ``out`` by the CLI (minutes on a loaded 2-core CPU)."""
    subprocess.run([str(REPO / ".venv/bin/mixrl-train"), "sft", "--config", str(CONFIG), "--out", str(out)],
                   check=True, cwd=REPO)
    return out


def publish_policy(policy: Path, out: Path, prompts: int, tokens: int, seed: int):
    """Version 0 of ``policy`` under ``out`` in the demo's formats, and its probe."""
    from convert.publish import publish
    from trainer_jax.calibration import Calibrator
    from trainer_jax.config import load_config
    from trainer_jax.models import load_hf
    from trainer_jax.probe import Prober
    from trainer_jax.publisher import snapshot
    from trainer_jax.service.tasks import build_task_source

    cfg = load_config(str(CONFIG))
    from convert.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(policy))
    source = build_task_source(cfg.tasks, tokenizer=tokenizer)
    model, qcfg = load_hf(policy)
    task_prompts = [source.spec(i).prompt_ids for i in range(prompts)]
    calibration = Calibrator(model, 256, prompts=lambda: [source.spec(prompts + i).prompt_ids
                                                          for i in range(16)],
                             kv_floor=cfg.train.weights.kv_scale_floor)(0)
    probe = Prober(task_prompts, tokens=tokens, seed=seed)(model, 0)
    publish(snapshot(model), qcfg.to_hf_dict(), out, 0, sorted({g[4] for g in GROUPS}), keep_last=None,
            calibration=calibration, kv_cache_formats=["nvfp4", "mxfp4"], engines="mixrl")
    return probe


def row(label: str, engine, probe) -> dict:
    from mixrl_wire.probe import compare, flatten

    logp = np.asarray(flatten(probe.logprobs), np.float64)
    logq = np.asarray(flatten(engine.score(probe.prompts, probe.continuations)), np.float64)
    c = compare(logp.tolist(), logq.tolist())
    ratio = np.exp(np.clip(logp - logq, -50, 50))  # r = p / q, as the objective's ratio
    oor = float(np.mean((ratio < C_MIN) | (ratio > C_MAX)))
    return {"group": label, "probe_kl": c.kl, "max_abs": c.max_abs, "mean_abs": c.mean_abs,
            "out_of_range": oor, "tokens": c.tokens}


def measure(policy: Path, bits: list[int], block: int, prompts: int, tokens: int, seed: int) -> dict:
    from mixrl_wire.recipes import get_recipe
    from sampler_torch.engine import Engine
    from sampler_torch.recipes.rounding import RoundWeights, with_round_weights

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        probe = publish_policy(policy, out, prompts, tokens, seed)
        rows = []
        for label, recipe, kv, attention, fmt in GROUPS:
            engine = Engine(out / "v00000000" / fmt, recipe, kv_cache_dtype=kv, attention=attention)
            rows.append(row(label, engine, probe))
        for k in bits:
            dial = with_round_weights(get_recipe("bf16"), RoundWeights(k, block))
            engine = Engine(out / "v00000000" / "bf16", dial)
            rows.append(row(f"bf16 round_weights K={k} B={block}", engine, probe) | {"bits": k,
                                                                                   "block_size": block})
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", type=Path, help="the demo's warm-started HF dir (default: made here)")
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 6, 5, 4, 3])
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/bench_round_weights.json")
    args = ap.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        policy = args.policy or warm_start(Path(tmp) / "policy")
        result = measure(policy, args.bits, args.block_size, args.prompts, args.tokens, args.seed)
        result["policy"] = (str(args.policy) if args.policy
                            else "warm start of configs/local_mixed.yaml (made here)")
    result |= {"config": "configs/local_mixed.yaml",
               "probe": f"{args.prompts} prompts x {args.tokens} tokens",
               "seed": args.seed, "machine": platform.processor() or platform.machine(),
               "seconds": round(time.time() - t0, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(result, indent=2) + "\n")
    tmp_out.replace(args.out)  # never a half-written result
    print(f"{'group':<32} {'probe KL':>10} {'out-of-range':>13} {'max |d|':>8}")
    for r in result["rows"]:
        print(f"{r['group']:<32} {r['probe_kl']:>10.3g} {r['out_of_range']:>13.4f} {r['max_abs']:>8.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
