"""Scale-out smoke check: the configured mesh, a few sharded train steps, a sharded checkpoint
round trip and a sharded publish, on the real cluster, before a long run.

    python -m trainer_jax.parallel.check --config configs/tpu_slice.yaml [key=value ...]
        [--steps 3] [--load] [--checkpoint-dir D [--restore-mesh fsdp=8]] [--publish-dir P]
        [--out report.json]

Run it on every process (the launch scripts in scripts/ do). It initialises ``jax.distributed``
from ``distributed:``, builds the mesh from ``mesh:``, creates the policy sharded (random init
from the config's shapes, or ``--load`` the HF weights of ``model.hf_dir``), and runs ``--steps``
steps on a synthetic batch of the configured ``train.rows x train.row_len`` shape (the same on
every process). Process 0 prints a JSON report: per-device parameter + optimizer bytes, XLA's
memory analysis of the step, compile and step times, losses.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from trainer_jax.config import ConfigError, MeshConfig, RunConfig, load_config


def synthetic_batch(vocab_size: int, *, rows: int, row_len: int, max_tokens: int, head_k: int,
                    support_k: int, seed: int = 0):
    """A packed batch of random trajectories: two per row, the second half of each is policy tokens."""
    from trainer_jax.batching import Sample, pack

    rng = np.random.default_rng(seed)
    length = max(2, row_len // 2)
    policy = length // 2
    samples = []
    for _ in range(2 * rows):
        ids = rng.integers(0, vocab_size, length).astype(np.int32)
        mask = np.zeros(length, np.int32)
        mask[length - policy:] = 1
        samples.append(Sample(
            token_ids=ids, loss_mask=mask, logprobs=np.full(policy, -math.log(vocab_size), np.float32),
            head_ids=rng.integers(0, vocab_size, (policy, head_k)).astype(np.int32),
            head_logprobs=np.full((policy, head_k), -math.log(vocab_size), np.float32),
            support_indptr=np.zeros(policy + 1, np.int32), support_ids=np.zeros(0, np.int32),
            support_logprobs=np.zeros(0, np.float32), versions=np.zeros(policy, np.int32)))
    adv = rng.normal(size=len(samples)).astype(np.float32)
    inputs, batch, _ = pack(samples, adv, rows=rows, row_len=row_len, max_tokens=max_tokens,
                            head_k=head_k, support_k=support_k, temperature=1.0, trainer_version=0)
    return inputs, batch


def _states_equal(a: Any, b: Any) -> bool:
    """Whether two global state pytrees (possibly on different meshes) hold the same values."""
    import jax
    import jax.numpy as jnp

    from trainer_jax.parallel.sharding import put_global

    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        y = put_global(y, x.sharding)
        worst = max(worst, float(jax.jit(lambda p, q: jnp.max(jnp.abs(p - q)).astype(jnp.float32),
                                         out_shardings=jax.sharding.NamedSharding(
                                             x.sharding.mesh, jax.P()))(x, y)))
    return worst == 0.0


def run_check(cfg: RunConfig, *, steps: int = 3, load: bool = False, vocab_size: int = 256,
              checkpoint_dir: str | None = None, restore_mesh: MeshConfig | None = None,
              publish_dir: str | None = None) -> dict[str, Any]:
    """The smoke check (see the module docstring); returns the report (on every process)."""
    from trainer_jax.parallel.distributed import init_distributed

    info = init_distributed(cfg.distributed)  # before anything touches a device

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from trainer_jax.learner import Learner
    from trainer_jax.parallel import ShardingRules, make_mesh
    from trainer_jax.parallel.memory import compiled_memory, state_memory_report
    from trainer_jax.parallel.mesh import describe
    from trainer_jax.parallel.sharding import init_sharded_model
    from trainer_jax.policy import DTYPES, build_policy, check_layout

    mesh = make_mesh(cfg.mesh)
    check_layout(cfg, mesh)
    if load and not cfg.model.hf_dir:
        raise ConfigError("--load needs model.hf_dir")
    t0 = time.perf_counter()
    # The run's policy (dtype, attention, remat), random unless --load.
    model, qcfg = build_policy(cfg, vocab_size, mesh=mesh, load_weights=load)
    rules = ShardingRules.for_model(qcfg, cfg.mesh.rules)
    objective = cfg.objective.model_copy(update={"num_groups": max(1, len(cfg.groups))})
    learner = Learner(model, cfg.optimizer, objective, mesh, rules, micro_rows=cfg.train.micro_rows,
                      context_attention=cfg.mesh.context_attention)
    init_s = time.perf_counter() - t0
    inputs, batch = synthetic_batch(qcfg.vocab_size, rows=cfg.train.rows, row_len=cfg.train.row_len,
                                    max_tokens=cfg.train.max_tokens, head_k=cfg.tasks.sampling.head_k,
                                    support_k=cfg.train.support_k, seed=cfg.run.seed)
    t0 = time.perf_counter()
    xla = compiled_memory(learner.compile_step(inputs, batch))
    compile_s = time.perf_counter() - t0
    losses, grad_norms, times = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        result = learner.step(inputs, batch)
        times.append(time.perf_counter() - t0)
        losses.append(result.loss)
        grad_norms.append(result.grad_norm)
    from trainer_jax.kernels.checked import describe_choice

    report: dict[str, Any] = {
        "mesh": describe(mesh), "platform": jax.devices()[0].platform,
        "processes": info.process_count, "devices": info.device_count,
        "distributed": info.reason, "remat": cfg.train.remat, "micro_rows": cfg.train.micro_rows,
        "attention": cfg.model.attention,
        # what auto picked here and why (trainer_jax/kernels/checked.py: the device check's record)
        "kernels": [describe_choice(k, c) for k, c in (("attention", cfg.model.attention),
                                                        ("linear_logsumexp", cfg.objective.impl))],
        "params": sum(x.size for x in jax.tree.leaves(nnx.state(learner.model, nnx.Param))),
        "memory": state_memory_report(learner.model, learner.optimizer), "xla_memory": xla,
        "init_s": round(init_s, 3), "compile_s": round(compile_s, 3),
        "first_step_s": round(times[0], 4) if times else None,
        "step_s": round(float(np.median(times[1:])), 4) if len(times) > 1 else None,
        "losses": losses, "grad_norms": grad_norms,
    }
    if checkpoint_dir is not None:
        from trainer_jax.checkpoint import Checkpointer

        ckpt = Checkpointer(checkpoint_dir, keep_last=1)
        ckpt.save(learner.step_count, learner.model, learner.optimizer, {"step": learner.step_count})
        ckpt.close()
        report["checkpoint"] = {"dir": str(checkpoint_dir), "step": learner.step_count}
        if restore_mesh is not None:
            other_mesh = make_mesh(restore_mesh)
            other = Learner(init_sharded_model(qcfg, other_mesh, rules, seed=cfg.model.seed + 1,
                                               dtype=DTYPES[cfg.model.dtype], param_dtype=jnp.float32),
                                   cfg.optimizer, objective, other_mesh, rules)
            Checkpointer(checkpoint_dir).restore(other.model, other.optimizer)
            report["checkpoint"].update(restored_on=describe(other_mesh),
                                        restored_equal=_states_equal(learner.state(), other.state()))
    if publish_dir is not None:
        from trainer_jax.parallel.publish import publish_sharded

        t0 = time.perf_counter()
        paths = publish_sharded(learner.model, qcfg, publish_dir, learner.step_count, ["bf16"],
                                keep_last=None)
        report["publish"] = {"dir": str(publish_dir), "s": round(time.perf_counter() - t0, 3),
                             "writer": paths is not None and jax.process_index() == 0}
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer_jax.parallel.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML run config (mesh:, distributed:, model:)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--load", action="store_true", help="load model.hf_dir instead of a random init")
    p.add_argument("--vocab-size", type=int, default=256, help="vocabulary of a tiny random model")
    p.add_argument("--checkpoint-dir", help="save a sharded checkpoint here (every process)")
    p.add_argument("--restore-mesh", help="then restore it onto this mesh, e.g. data=2,fsdp=4")
    p.add_argument("--publish-dir", help="publish the weights (bf16) here from process 0")
    p.add_argument("--out", help="also write the report (process 0) to this JSON file")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_intermixed_args(argv)  # key=value before or after the flags
    try:
        cfg = load_config(args.config, args.overrides)
        restore = None
        if args.restore_mesh:
            sizes = dict(kv.split("=") for kv in args.restore_mesh.split(","))
            restore = MeshConfig(**{k: int(v) for k, v in sizes.items()})
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = run_check(cfg, steps=args.steps, load=args.load, vocab_size=args.vocab_size,
                       checkpoint_dir=args.checkpoint_dir, restore_mesh=restore,
                       publish_dir=args.publish_dir)
    import jax

    if jax.process_index() == 0:
        text = json.dumps(report, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
