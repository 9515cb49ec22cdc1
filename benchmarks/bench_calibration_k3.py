"""Mismatch (k3) of the W4A4 and FP8-KV sampler recipes against the trainer, with and without
the scales calibrated at publish time (issue 21 item 4).

One policy (an HF directory: a trained run's bf16 export). The trainer's JAX policy (float32,
the trainer's default compute dtype) is calibrated on ``--tokens`` tokens of completions the bf16
engine sampled for one set of task prompts (``trainer_jax.calibration.Calibrator``, what the
training loop runs), and the export is published (a) without calibration (``input_scale`` 1.0,
KV scales 1.0), (b) with it, (c) with it and ModelOpt's FP8 KV floor (``k_scale``/``v_scale``
at least 1.0). Under each recipe, the mixrl engine loading that export samples completions for
*other* prompts (so the scales are tested out of sample), recording log b(x) as a sampler does;
the trainer scores the same tokens. Per completion token ``r = pi_trainer(x) / b(x)`` and
``k3 = r - 1 - log r`` (the diagnostics' estimator of KL(b || pi), x ~ b); reported: the mean
over tokens and the mean ``|log r|``, and, free of sampling noise, the exact KL(b || pi) per
position averaged over one shared set of bf16-sampled completions every variant scores
(teacher-forced through the engine, K/V through its cache).

    nice -n 10 .venv/bin/python benchmarks/bench_calibration_k3.py --hf DIR \\
        [--config configs/local_mixed.yaml] [--tokens 256] [--out benchmarks/results/...json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.publish import publish
from convert.tokenizer import load_tokenizer
from trainer_jax.calibration import Calibrator
from trainer_jax.config import load_config
from trainer_jax.models import load_hf
from trainer_jax.service.tasks import build_task_source

# (label, recipe, KV dtype): W4A4 alone, FP8 KV alone, and both (the demo's nvfp4 group).
VARIANTS = [("nvfp4_w4a4", "nvfp4_w4a4", "auto"), ("bf16 + fp8 KV", "bf16", "fp8_e4m3"),
            ("nvfp4_w4a4 + fp8 KV", "nvfp4_w4a4", "fp8_e4m3")]


def sample(engine, prompts: list[list[int]], sampling, seed: int):
    """Completions of ``prompts`` sampled by ``engine`` (no truncation), with log b(x)."""
    params = dataclasses.replace(sampling, seed=seed, top_p=1.0, top_k=0)
    return engine.generate(prompts, params)


def _log_softmax(z: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(z, np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _positions(c) -> np.ndarray:
    """Rows of a full-sequence logits array that predict the completion's tokens."""
    return np.arange(len(c.prompt_ids) - 1, len(c.prompt_ids) + len(c.token_ids) - 1)


@nnx.jit
def _forward(model, ids):
    return model(ids)


def trainer_logp(model, completions, temperature: float) -> list[np.ndarray]:
    """log softmax(logits / T) ``[n_tokens, V]`` at each completion's positions under ``model``:
    one jitted forward over the right-padded batch (causal: padding changes no earlier row)."""
    seqs = [c.prompt_ids + c.token_ids for c in completions]
    width = -(-max(len(s) for s in seqs) // 32) * 32  # few distinct shapes: few compilations
    ids = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    logits = np.asarray(jax.device_get(_forward(model, jnp.asarray(ids))))
    return [_log_softmax(logits[i, _positions(c)], temperature) for i, c in enumerate(completions)]


def engine_logp(engine, completions, temperature: float) -> list[np.ndarray]:
    """The same for the engine (teacher-forced, K/V through its cache dtype)."""
    logits = engine.logits([c.prompt_ids + c.token_ids for c in completions])
    return [_log_softmax(lg.numpy()[_positions(c)], temperature)
            for lg, c in zip(logits, completions, strict=True)]


def sampled(logp: list[np.ndarray], completions) -> list[np.ndarray]:
    return [lp[np.arange(len(c.token_ids)), c.token_ids] for lp, c in zip(logp, completions,
                                                                            strict=True)]


def mismatch(train: list[np.ndarray], sampler: list[np.ndarray]) -> dict[str, float]:
    """k3 = r - 1 - log r and |log r| per sampled token, r = pi(x) / b(x), averaged."""
    log_r = np.concatenate(train) - np.concatenate(sampler)
    k3 = np.exp(log_r) - 1 - log_r
    return {"k3": float(k3.mean()), "mean_abs_log_r": float(np.abs(log_r).mean()),
            "tokens": int(log_r.size)}


def exact_kl(sampler: list[np.ndarray], train: list[np.ndarray]) -> float:
    """Mean over positions of KL(b || pi) = sum_v b_v (log b_v - log pi_v), what k3 estimates."""
    b, p = np.concatenate(sampler), np.concatenate(train)
    return float((np.exp(b) * (b - p)).sum(-1).mean())


def main(argv: list[str] | None = None) -> dict:
    from sampler_torch.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf", required=True, help="the policy as an HF directory (bf16 export)")
    ap.add_argument("--config", default="configs/local_mixed.yaml", help="tasks and sampling")
    ap.add_argument("--tokens", type=int, default=256, help="calibration tokens")
    ap.add_argument("--calib-prompts", type=int, default=32)
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/bench_calibration_k3.json")
    ap.add_argument("--settings", nargs="*", default=[], help="only these settings (and no bf16 "
                    "reference), e.g. calibrated")
    ap.add_argument("--variants", nargs="*", default=[], help="only these recipe labels")
    args = ap.parse_args(argv)
    started = time.time()
    cfg = load_config(args.config)
    tok = load_tokenizer(args.hf)
    source = build_task_source(cfg.tasks, tokenizer=tok, seed=args.seed)
    temperature = cfg.tasks.sampling.temperature
    calib_prompts = [list(source.spec(i).prompt_ids) for i in range(args.calib_prompts)]
    eval_prompts = [list(source.spec(10_000 + i).prompt_ids) for i in range(args.eval_prompts)]
    calib = sample(Engine(args.hf, "bf16", max_batch=64), calib_prompts, cfg.tasks.sampling,
                   args.seed)

    model, qcfg = load_hf(args.hf, jnp.float32)
    calibrator = Calibrator(model, args.tokens)
    calibrator.observe(c.prompt_ids + c.token_ids for c in calib)
    calibration = calibrator(version=0)
    scales = {"calibration": {"tokens": calibration.tokens, "sequences": calibration.sequences,
                              "input_amax": dict(calibration.input_amax),
                              "kv_amax": {str(k): v for k, v in calibration.kv_amax.items()}}}

    # Shared tokens: completions the bf16 engine sampled; every variant is scored on them (exact
    # KL, no sampling noise between variants).
    shared = [c for c in sample(Engine(args.hf, "bf16", max_batch=64), eval_prompts,
                                cfg.tasks.sampling, args.seed + 2) if c.token_ids]
    shared_train = trainer_logp(model, shared, temperature)

    def measure(engine) -> dict[str, float]:
        done = [c for c in sample(engine, eval_prompts, cfg.tasks.sampling, args.seed + 1)
                if c.token_ids]
        train = sampled(trainer_logp(model, done, temperature), done)
        out = mismatch(train, [np.asarray(c.logprobs, np.float64) for c in done])
        out["kl_exact_shared"] = exact_kl(engine_logp(engine, shared, temperature), shared_train)
        return out

    settings = {"uncalibrated": None,
                "calibrated": dataclasses.replace(calibration, kv_floor=0.0),
                "calibrated, KV floor 1.0 (ModelOpt)": dataclasses.replace(calibration,
                                                                            kv_floor=1.0)}
    settings = {k: v for k, v in settings.items() if not args.settings or k in args.settings}
    tensors = dict(_tensors(args.hf))
    results: dict[str, dict] = {}
    if not args.settings:
        results["bf16 (reference)"] = {"-": measure(Engine(args.hf, "bf16"))}
        print(f"bf16 (reference) {results['bf16 (reference)']['-']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for n, (setting, cal) in enumerate(settings.items()):
            paths = publish(tensors, qcfg.to_hf_dict(), Path(tmp) / str(n), 0, ["bf16", "nvfp4"],
                            tokenizer_dir=args.hf, engines="mixrl", calibration=cal,
                            kv_cache_formats=["bf16", "nvfp4"], keep_last=None)
            for label, recipe, kv in VARIANTS:
                fmt = "nvfp4" if recipe.startswith("nvfp4") else "bf16"
                if (cal is not None and cal.kv_floor and kv == "auto") or (
                        args.variants and label not in args.variants):
                    continue  # (the KV floor changes nothing without an fp8 KV cache)
                got = measure(Engine(paths[fmt], recipe, kv_cache_dtype=kv, max_batch=64))
                results.setdefault(label, {})[setting] = got
                print(f"{label:22s} {setting:38s} k3 {got['k3']:.3e} |log r| "
                      f"{got['mean_abs_log_r']:.3e} KL {got['kl_exact_shared']:.3e}", flush=True)
    report = {"hf": str(args.hf), "config": args.config, "tokens": args.tokens,
              "argv": argv if argv is not None else __import__("sys").argv[1:],
              "eval_prompts": args.eval_prompts, "seconds": round(time.time() - started, 1),
              "results": results, **scales}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _tensors(hf_dir: str):
    from convert.hf_checkpoint import HFCheckpoint

    ck = HFCheckpoint(hf_dir)
    for name in ck.names():
        yield name, np.asarray(ck.get(name), np.float32)


if __name__ == "__main__":
    main()
