"""The version probe's numbers per recipe (issue 32 item 3): what each recipe shows at equal
weights (its bound and noise), how far consecutive versions move at learning rates 1e-3 and 1e-6
(whether "serves the previous version" is decidable), and what two calibration faults look like.

Per seed: a random Qwen3 of ``SHAPE`` (the trainer's float32 JAX policy), as is and with
activation outliers (``add_outliers``), calibrated on random
prompts with ``kv_scale_floor`` 0 (scales ``amax / 448``), published in every weight format with
the probe (``trainer_jax.probe.Prober``: 4 prompts x 16 tokens, what ``service.probe`` defaults
to). The mixrl engine loads each export under each recipe on this machine's CPU and scores the
probe (``Engine.score``); ``mixrl_wire.probe.compare`` gives KL(p || q) (k3), max and mean
|Δ log p|. One Adam step at ``lr`` (on the NLL of random tokens) makes the next version; its probe
carries the previous continuation scored by both, whose mean |Δ log p| is the separation.

Faults, on the outlier policy (where scales matter), each on the export it breaks: the
fp8_block export's calibrated K/V scales overwritten with 1.0 (a pipeline that drops calibrated
FP8 KV scales, NeMo-RL #3225) under ``fp8`` with an fp8_e4m3 KV cache; the nvfp4 export's
``input_scale`` overwritten with 1.0 under ``nvfp4_w4a4``.

Bounds (``--write-bounds`` writes ``trainer_jax/service/probe_bounds.json``): per recipe on
``engine/cpu``, KL bound = 4 x and max |Δ| bound = 2 x the largest value over seeds; noise = the
mean |Δ log p| averaged over seeds. Measured on the CPU only: they alarm, never enforce, on GPUs.

    .venv/bin/python benchmarks/bench_probe.py [--seeds 3] [--write-bounds] \\
        [--out benchmarks/results/bench_probe.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
FORMATS = ["bf16", "fp8_block", "nvfp4", "mxfp4", "w8a8_int8"]
#: (label, recipe, KV cache dtype, export format)
VARIANTS = [("bf16", "bf16", "auto", "bf16"), ("fp8", "fp8", "auto", "fp8_block"),
            ("fp8+fp8kv", "fp8", "fp8_e4m3", "fp8_block"),
            ("int8", "int8", "auto", "w8a8_int8"),
            ("mxfp4_w4a16", "mxfp4_w4a16", "auto", "mxfp4"),
            ("nvfp4_w4a16", "nvfp4_w4a16", "auto", "nvfp4"),
            ("nvfp4_w4a4", "nvfp4_w4a4", "auto", "nvfp4")]
PROMPTS, TOKENS = 4, 16


def _scale(param, factor: float) -> None:
    param.set_value(param.get_value() * factor)


def add_outliers(model, factor: float = 2000.0) -> None:
    """Reparametrize ``model`` without changing its function (up to rounding) so that what the
    KV cache stores is large (K and V x ``factor``: k_norm / v_proj up, q_norm / o_proj down) and
    the attention projections' inputs small (input_layernorm / ``factor``, q/k/v_proj up): the
    regime where calibrated FP8 KV scales and NVFP4 global input scales matter, as they do in real
    checkpoints whose K/V amax is far from 448 and whose activations are far from 1."""
    for layer in model.layers:
        att = layer.self_attn
        _scale(att.k_norm.weight, factor)
        _scale(att.q_norm.weight, 1 / factor)
        _scale(att.v_proj.kernel, factor)
        _scale(att.o_proj.kernel, 1 / factor)
        _scale(layer.input_layernorm.weight, 1 / factor)
        for proj in (att.q_proj, att.k_proj, att.v_proj):
            _scale(proj.kernel, factor)


def adam_step(model, ids: np.ndarray, lr: float):
    """``model`` after one Adam step at ``lr`` on the next-token NLL of ``ids``."""
    import jax
    import optax
    from flax import nnx

    graphdef, state = nnx.split(model)

    def nll(st):
        lp = jax.nn.log_softmax(nnx.merge(graphdef, st)(ids[:, :-1]), -1)
        return -jax.numpy.take_along_axis(lp, ids[:, 1:, None], -1).mean()

    opt = optax.adam(lr)
    updates, _ = opt.update(jax.grad(nll)(state), opt.init(state), state)
    return nnx.merge(graphdef, optax.apply_updates(state, updates))


def build_case(seed: int, out: Path, *, lr: float | None = None, formats=FORMATS,
               outliers: bool = False):
    """Publish version 0 of a random policy (``outliers``: ``add_outliers`` applied; and, with
    ``lr``, version 1 after one Adam step) under ``out`` with calibrated scales (floor 0) and the
    probe; return the probes."""
    from convert.publish import publish
    from convert.qwen3_config import Qwen3Config
    from trainer_jax.calibration import Calibrator
    from trainer_jax.models import init_model
    from trainer_jax.probe import Prober
    from trainer_jax.publisher import snapshot

    cfg = Qwen3Config(**SHAPE)
    model = init_model(cfg, seed=seed)
    if outliers:
        add_outliers(model)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, cfg.vocab_size, 12).tolist() for _ in range(PROMPTS)]
    calib = [rng.integers(1, cfg.vocab_size, 64).tolist() for _ in range(8)]
    prober = Prober(prompts, tokens=TOKENS, seed=seed)
    probes = []
    for version in (0, 1) if lr is not None else (0,):
        if version == 1:
            ids = np.asarray(rng.integers(1, cfg.vocab_size, (4, 32)), np.int32)
            model = adam_step(model, ids, lr)
        calibration = Calibrator(model, 256, prompts=lambda: calib, kv_floor=0.0)(version)
        probe = prober(model, version)
        publish(snapshot(model), cfg.to_hf_dict(), out, version, formats, keep_last=None,
                calibration=calibration, kv_cache_formats=["fp8_block"], engines="mixrl",
                extra_json={"probe.json": probe.to_json()})
        probes.append(probe)
    return probes


def version_dir(out: Path, version: int, fmt: str) -> Path:
    return out / f"v{version:08d}" / fmt


def score(path: Path, recipe: str, kv: str, probe) -> list[float]:
    """The engine's log q of the probe's continuation under ``recipe`` (flat)."""
    from mixrl_wire.probe import flatten
    from sampler_torch.engine import Engine

    engine = Engine(path, recipe, kv_cache_dtype=kv)
    return flatten(engine.score(probe.prompts, probe.continuations))


def force_scales(export: Path, suffixes: tuple[str, ...], value: float = 1.0) -> int:
    """Overwrite every tensor whose name ends with one of ``suffixes`` with ``value`` and rewrite
    the manifest (a pipeline bug that writes a consistent, wrong export); return how many."""
    import torch
    from safetensors.torch import load_file, save_file

    from convert.manifest import write_manifest

    n = 0
    for shard in sorted(export.glob("*.safetensors")):
        tensors = load_file(shard)
        hit = {k for k in tensors if k.endswith(suffixes)}
        for k in hit:
            tensors[k] = torch.full_like(tensors[k], value)
        if hit:
            save_file(tensors, shard, metadata={"format": "pt"})
            n += len(hit)
    meta = json.loads((export / "manifest.json").read_text())
    (export / "manifest.json").unlink()
    write_manifest(export, **{k: v for k, v in meta.items() if k not in ("files", "manifest_version")})
    return n


def measure(seeds: int) -> dict:
    """Per seed: every variant on the plain and the ``outliers`` policy (healthy exports), the
    separation at both learning rates, and the two faults on the ``outliers`` policy."""
    from mixrl_wire.probe import compare, flatten

    rows: dict[str, list[dict]] = {label: [] for label, *_ in VARIANTS}
    separation: dict[str, list[float]] = {"1e-3": [], "1e-6": []}
    faults: dict[str, list[dict]] = {"fp8 kv scales forced to 1.0": [],
                                     "nvfp4 input_scale forced to 1.0": []}
    for seed in range(seeds):
        for lr_name, lr in (("1e-3", 1e-3), ("1e-6", 1e-6)):
            with tempfile.TemporaryDirectory() as tmp:
                _, p1 = build_case(seed, Path(tmp), lr=lr, formats=["bf16"])
                prev = p1.previous
                separation[lr_name].append(
                    compare(flatten(prev.logprobs), flatten(prev.logprobs_now)).mean_abs)
        for outliers in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp)
                (p0,) = build_case(seed, out, outliers=outliers)
                for label, recipe, kv, fmt in VARIANTS:
                    c = compare(flatten(p0.logprobs),
                                score(version_dir(out, 0, fmt), recipe, kv, p0))
                    rows[label].append({"seed": seed, "outliers": outliers, "kl": c.kl,
                                        "max_abs": c.max_abs, "mean_abs": c.mean_abs})
                if not outliers:
                    continue
                fp8 = version_dir(out, 0, "fp8_block")
                force_scales(fp8, (".k_scale", ".v_scale"))
                c = compare(flatten(p0.logprobs), score(fp8, "fp8", "fp8_e4m3", p0))
                faults["fp8 kv scales forced to 1.0"].append(
                    {"seed": seed, "kl": c.kl, "max_abs": c.max_abs, "variant": "fp8+fp8kv"})
                nv = version_dir(out, 0, "nvfp4")
                force_scales(nv, (".input_scale",))
                c = compare(flatten(p0.logprobs), score(nv, "nvfp4_w4a4", "auto", p0))
                faults["nvfp4 input_scale forced to 1.0"].append(
                    {"seed": seed, "kl": c.kl, "max_abs": c.max_abs, "variant": "nvfp4_w4a4"})
    return {"rows": rows, "separation": separation, "faults": faults}


def bounds_from(rows: dict[str, list[dict]]) -> dict[str, dict]:
    """``probe_bounds.json``'s entries: per recipe on engine/cpu (the KV variant keyed by recipe
    ``fp8`` with its KV dtype is the looser of the two, since the key has no KV dtype)."""
    out: dict[str, dict] = {}
    for label, recipe, _, _ in VARIANTS:
        r = rows[label]
        entry = {"kl": 4 * max(x["kl"] for x in r), "max_abs": 2 * max(x["max_abs"] for x in r),
                 "noise": float(np.mean([x["mean_abs"] for x in r])), "measured_on": "cpu"}
        key = f"{recipe}/engine/cpu"
        if key in out:  # fp8 with and without an fp8 KV cache share a key: keep the looser
            entry = {k: max(out[key][k], entry[k]) if k != "measured_on" else "cpu" for k in entry}
        out[key] = entry
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/bench_probe.json")
    p.add_argument("--write-bounds", action="store_true")
    args = p.parse_args()
    t0 = time.time()
    res = measure(args.seeds)
    bounds = bounds_from(res["rows"])
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    measured = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "seeds": args.seeds,
                "shape": SHAPE, "probe": {"prompts": PROMPTS, "tokens": TOKENS},
                "device": "cpu", "command": "python benchmarks/bench_probe.py --write-bounds"}
    noise = {k: v["noise"] for k, v in bounds.items()}
    ratio = {lr: {k: float(np.min(sep)) / n for k, n in noise.items()}
             for lr, sep in res["separation"].items()}
    res.update(measured=measured, bounds=bounds, separation_over_noise_min=ratio,
               seconds=round(time.time() - t0, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"{'variant':<12} {'KL max':>9} {'max|d| max':>11} {'noise':>9}")
    for label, r in res["rows"].items():
        print(f"{label:<12} {max(x['kl'] for x in r):9.2e} {max(x['max_abs'] for x in r):11.4f} "
              f"{np.mean([x['mean_abs'] for x in r]):9.2e}")
    for lr, sep in res["separation"].items():
        print(f"separation at lr {lr}: min {min(sep):.2e} median {np.median(sep):.2e}; / noise: "
              + ", ".join(f"{k.split('/')[0]} {v:.1f}" for k, v in ratio[lr].items()))
    for name, r in res["faults"].items():
        print(f"fault '{name}': KL {min(x['kl'] for x in r):.2e}..{max(x['kl'] for x in r):.2e}")
    if args.write_bounds:
        path = REPO / "trainer_jax/service/probe_bounds.json"
        path.write_text(json.dumps({"measured": measured, "bounds": bounds}, indent=2) + "\n")
        print(f"wrote {path.relative_to(REPO)}")
    print(f"{res['seconds']} s -> {args.out}")


if __name__ == "__main__":
    main()
