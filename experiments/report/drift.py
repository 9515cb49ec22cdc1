"""Drift: the batch gradient of the objective under a constant advantage, on real sampler outputs.

The only part of the report that needs JAX; it imports it inside ``drift_gradients`` so that reading
runs and writing the report without the drift analysis never loads it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from experiments.report.runs import RunResult


def drift_gradients(run_dir: str | os.PathLike, *, advantage: float = 1.0) -> dict:
    """Gradient norms of the objective with every advantage = ``advantage`` on a run's saved batch.

    With a constant advantage GRPO's signal is zero, so whatever gradient remains is drift: for
    x ~ b the uncorrected term -A log p(x) has expectation -A sum_x b(x) grad log p(x), which points
    toward the sampler distribution b; score centering subtracts exactly that expectation over the
    head (docs/design.md section 4), leaving zero-mean sampling noise. Reported per batch and per sampler
    group: ``uncorrected`` (is none, no SC, no replay), ``sc`` (is none + SC), ``sc_mis_replay``, and
    ``drift`` = |g_uncorrected - g_sc| (the analytic expected gradient that SC removes; it is the
    same quantity estimated without sampling noise). Needs ``trajectories.pkl`` (written when the
    cell ran with ``MIXRL_SAVE_TRAJECTORIES``) and the run's latest bf16 weights. The result is also
    written to the run's ``drift.json``.
    """
    import pickle
    import tempfile

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from convert.delta import materialize
    from convert.store import open_store
    from trainer_jax.batching import pack
    from trainer_jax.config import load_config
    from trainer_jax.learner import loss_and_metrics
    from trainer_jax.models import load_hf
    from trainer_jax.objective import ObjectiveConfig

    run_dir = Path(run_dir)
    saved = pickle.loads((run_dir / "trajectories.pkl").read_bytes())
    latest = (run_dir / "weights" / "LATEST").read_text().strip()
    with tempfile.TemporaryDirectory() as tmp:
        # The newest version may be stored as a delta: materialize its full bf16 directory.
        bf16 = Path(tmp) / "bf16"
        materialize(open_store(run_dir / "weights"), int(latest.lstrip("v")), "bf16", bf16)
        model, _ = load_hf(bf16, dtype=jnp.float32, param_dtype=jnp.float32)
    cell = json.loads((run_dir / "cell.json").read_text()) if (run_dir / "cell.json").exists() else {}
    cmd = cell.get("command", [])
    cfg_path = cmd[cmd.index("--config") + 1] if "--config" in cmd else None
    overrides = [a for a in cmd if "=" in a and not a.startswith("-")]
    cfg = load_config(cfg_path, overrides) if cfg_path else None
    s = cfg.tasks.sampling if cfg else None
    head_k = s.head_k if s else saved["samples"][0].head_ids.shape[1]
    temperature = s.temperature if s else 1.0
    support_k = cfg.train.support_k if cfg else 64
    variants = {
        "uncorrected": ObjectiveConfig(is_mode="none", score_centering=False, top_p_replay=False),
        "sc": ObjectiveConfig(is_mode="none", score_centering=True, top_p_replay=False),
        "sc_mis_replay": ObjectiveConfig(is_mode="mis", score_centering=True, top_p_replay=True),
    }

    def grads_for(samples) -> dict[str, object]:
        total = sum(len(x.token_ids) for x in samples)
        n_tok = sum(x.num_policy_tokens for x in samples)
        row_len = 1 << max(6, int(math.ceil(math.log2(max(len(x.token_ids) for x in samples)))))
        rows = max(1, int(math.ceil(total / row_len)) + len(samples) // 4 + 1)
        inputs, batch, taken = pack(
            samples,
            np.full(len(samples), advantage, np.float32),
            rows=rows,
            row_len=row_len,
            max_tokens=max(8, n_tok),
            head_k=head_k,
            support_k=support_k,
            temperature=temperature,
            trainer_version=saved["trainer_version"],
        )
        out = {"samples": len(taken), "tokens": n_tok}
        for name, obj in variants.items():

            def loss_fn(m, obj=obj):
                return loss_and_metrics(m, inputs, batch, obj)[0]

            g = nnx.grad(loss_fn)(model)
            out[name] = g
        return out

    def norms(res: dict) -> dict[str, float]:
        d = {k: float(optax.tree.norm(res[k])) for k in variants}
        d["drift"] = float(optax.tree.norm(jax.tree.map(lambda a, b: a - b, res["uncorrected"], res["sc"])))
        d["samples"], d["tokens"] = res["samples"], res["tokens"]
        return d

    samples = saved["samples"]
    result = {"step": saved["step"], "advantage": advantage, "batch": norms(grads_for(samples)), "groups": {}}
    for gi, gname in enumerate(saved["group_names"]):
        sub = [x for x in samples if x.group == gi]
        if sub:
            result["groups"][gname] = norms(grads_for(sub))
    (run_dir / "drift.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def drift_for_report(
    results: list[RunResult], conditions: Sequence[str], log: Callable[[str], object]
) -> dict[str, dict]:
    """``drift_gradients`` of each finished run of ``conditions`` that saved its trajectories (of every
    such run when none of those did), keyed ``pool/condition/seedN``.

    A ``drift.json`` at least as new as the run's ``trajectories.pkl`` is read instead of recomputed;
    a run whose analysis fails is logged and left out, so the report is still written.
    """
    drift: dict[str, dict] = {}
    candidates = [r for r in results if r.ok and (r.run_dir / "trajectories.pkl").exists()]
    for r in [r for r in candidates if r.condition in conditions] or candidates:
        name = f"{r.pool}/{r.condition}/seed{r.seed}"
        try:
            cached = r.run_dir / "drift.json"
            if cached.exists() and cached.stat().st_mtime >= (r.run_dir / "trajectories.pkl").stat().st_mtime:
                drift[name] = json.loads(cached.read_text())
            else:
                drift[name] = drift_gradients(r.run_dir)
        except Exception as e:  # the report must still be written; say what failed
            log(f"drift analysis of {name} failed: {e!r}")
    return drift
