"""Weight sync after one RL step: full exports vs deltas, per format, in one run.

A Qwen3-shaped model (default: Qwen3-0.6B's shape, random N(0, 0.02) weights) takes one AdamW
step at lr 1e-6 on the gradient of a real loss (next-token cross-entropy of the JAX model on a
batch of token ids). Versions v0 (before) and v1 (after) are published in every format:

- baseline: a full publish of v1 (what every version cost before deltas), bytes and time;
- delta: v1 published as a delta against v0 (``publish(delta=True)``), bytes and time;
- sampler side: materializing v1 from the v0 it holds plus the delta, every file verified against
  the manifest (``convert.delta.materialize``: each file written once and hashed as it is
  written), vs reading and verifying the full v1 export (what a sampler on a shared filesystem
  did before), both from the page cache, interleaved ``--repeats`` times (min / median / max).
  Beside them, copying the full export to a new directory (no hashing): the cost of just
  producing a version's files on this machine, which an apply pays and a read does not.

With ``--s3`` the same two versions are also uploaded to a real S3-compatible server (moto, a
separate process on loopback) and the sampler side is measured as a remote sampler does it,
through s3fs: fetching the full v1 export and verifying it vs fetching the v1 delta and applying
it to the held v0 (``materialize`` from the store in both cases), interleaved with the local runs.
Loopback is the fastest link such a sampler will ever have; the measured rate is in the JSON.

The projection scales the measured bytes per parameter to Qwen3-30B-A3B (30.5 B parameters) at
the stated bandwidth (transfer + apply time), quoted beside Miles' published Qwen3-30B-A3B weight
sync (2.16 s RDMA / 2.67 s NCCL on H100). JSON goes to benchmarks/results/bench_weight_sync.json.

    .venv/bin/python benchmarks/bench_weight_sync.py --repeats 3   # the README's: Qwen3-0.6B, 13.3 GB RSS
    .venv/bin/python benchmarks/bench_weight_sync.py --layers 8 --batch 1 --seq 32   # 281 M params, ~6.5 GB
    .venv/bin/python benchmarks/bench_weight_sync.py --layers 8 --batch 1 --seq 32 --s3  # + loopback S3
    .venv/bin/python benchmarks/bench_weight_sync.py --layers 2      # quick look
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

FORMATS = ["bf16", "fp8_block", "nvfp4", "mxfp4", "w8a8_int8"]
TARGET = {"bf16": 0.10, "fp8_block": 0.03, "nvfp4": 0.03, "mxfp4": 0.03, "w8a8_int8": 0.03}
QWEN3_30B_A3B_PARAMS = 30.5e9
MILES_S = {"rdma_h100": 2.16, "nccl_h100": 2.67}


def one_adamw_step(args, publish_v0: Callable[[dict, object], None]) -> tuple[dict, object, dict]:
    """``(v1, config, info)``: HF-named fp32 tensors after one AdamW step; ``publish_v0(v0,
    config)`` gets those before it, called before the gradient so both are never held at once
    with the model, its gradient and the updated copy (the full 0.6 B shape's peak memory)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from convert.qwen3_config import Qwen3Config
    from trainer_jax.models import init_model, iter_hf_tensors

    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim, tie_word_embeddings=True)
    model = init_model(cfg, seed=0)
    v0 = {k: np.array(a, np.float32) for k, a in iter_hf_tensors(model)}
    n = sum(a.size for a in v0.values())
    publish_v0(v0, cfg)
    del v0
    ids = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, args.vocab)

    def loss_fn(m):
        logits = m(ids)[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    t0 = time.perf_counter()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    grad_s = time.perf_counter() - t0
    params, grads = nnx.state(model, nnx.Param), nnx.state(grads, nnx.Param)
    # AdamW's first step in closed form (bias-corrected m = g, v = g^2), leaf by leaf so no
    # optimizer state for the whole model is held; checked against optax on one leaf below.
    lr, wd, eps = args.lr, args.weight_decay, 1e-8

    def step(p, g):
        return p - lr * (g / (jnp.abs(g) + eps) + wd * p)

    leaf_p, leaf_g = jax.tree.leaves(params)[-1], jax.tree.leaves(grads)[-1]
    opt = optax.adamw(lr, eps=eps, weight_decay=wd)
    upd, _ = opt.update(leaf_g, opt.init(leaf_p), leaf_p)
    assert np.allclose(np.asarray(leaf_p + upd), np.asarray(step(leaf_p, leaf_g)), rtol=0, atol=1e-12)
    new = jax.tree.map(step, params, grads)
    del params, grads, leaf_p, leaf_g, upd
    nnx.update(model, new)
    del new
    v1 = {k: np.array(a, np.float32) for k, a in iter_hf_tensors(model)}
    info = {"params_m": round(n / 1e6, 1), "loss": round(float(loss), 4), "grad_seconds": round(grad_s, 2),
            "lr": lr, "weight_decay": wd, "batch": [args.batch, args.seq]}
    return v1, cfg, info


def _stats(runs: list[tuple[float, float]]) -> dict:
    """min / median / max of (wall, CPU) seconds over repeated runs."""
    out = {}
    for i, key in enumerate(("wall_s", "cpu_s")):
        xs = sorted(r[i] for r in runs)
        out[key] = {"min": round(xs[0], 3), "median": round(float(np.median(xs)), 3), "max": round(xs[-1], 3)}
    return out


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@contextmanager
def s3_on_loopback(log: Path) -> Iterator[str]:
    """A moto S3 server in its own process on 127.0.0.1 (so it does not share the client's GIL),
    logging to ``log``; sets the credentials and endpoint s3fs reads from the environment."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with log.open("w") as log_file:  # the child keeps its own descriptor
        server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1",
                                   "-p", str(port)], stdout=log_file, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint})
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError("moto_server did not start")
        yield endpoint
    finally:
        server.terminate()
        server.wait()


def upload_to_s3(delta_root: Path, full_root: Path) -> dict:
    """Copy both local publish roots to the loopback server's bucket; ``{"delta", "full"}`` stores."""
    import s3fs

    from convert.store import open_store

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.mkdir("bench")
    stores = {}
    for name, root in (("delta", delta_root), ("full", full_root)):
        fs.put(f"{root}/", f"bench/{name}/", recursive=True)
        stores[name] = open_store(f"s3://bench/{name}")
    return stores


def _s3_summary(stats: dict, full_b: int) -> dict:
    fetch_full = stats["s3_fetch_full"]["wall_s"]["median"]
    fetch_delta = stats["s3_fetch_delta_apply"]["wall_s"]["median"]
    return {"s3_loopback": {
        "fetch_full_verify_s": fetch_full, "fetch_delta_apply_verify_s": fetch_delta,
        "delta_faster_than_full_fetch": fetch_delta < fetch_full,
        "full_fetch_rate_mb_s": round(full_b / fetch_full / 1e6, 1),
        "runs": {k: stats[k] for k in ("s3_fetch_full", "s3_fetch_delta_apply")}}}


def add_step_args(ap: argparse.ArgumentParser, *, layers: int = 28, batch: int = 2, seq: int = 128) -> None:
    """The model shape and the AdamW step ``one_adamw_step`` reads (Qwen3-0.6B's widths)."""
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--seq", type=int, default=seq)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--weight-decay", type=float, default=0.0)


def shape_of(args) -> dict:
    """The model shape as the JSON records it."""
    return {"vocab": args.vocab, "hidden": args.hidden, "intermediate": args.intermediate,
            "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_args(ap)
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    ap.add_argument("--bandwidth-gbps", type=float, default=100.0,
                    help="network bandwidth of the projection, gigabits/s (default 100)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="sampler-side measurements per format, interleaved (default 3)")
    ap.add_argument("--s3", action="store_true",
                    help="also measure the sampler side against a loopback S3 server (moto, s3fs)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on disk)")
    ap.add_argument("--out", default="benchmarks/results/bench_weight_sync.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_weight_sync-", dir=args.dir))
    moto_log = Path(tempfile.gettempdir()) / "bench_weight_sync-moto.log"
    with s3_on_loopback(moto_log) if args.s3 else contextlib.nullcontext():
        try:
            _run(args, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _run(args, work: Path) -> None:
    from convert.delta import DELTA_VERSION, materialize
    from convert.manifest import check_manifest
    from convert.publish import publish
    from convert.store import open_store

    delta_root, full_root = work / "delta", work / "full"
    v0_s = 0.0

    def publish_v0(v0: dict, cfg) -> None:
        nonlocal v0_s
        t0 = time.perf_counter()
        publish(v0, cfg, delta_root, 0, args.formats, delta=True, keep_last=None)
        v0_s = time.perf_counter() - t0

    v1, cfg, info = one_adamw_step(args, publish_v0)
    full_report: dict = {}
    t0 = time.perf_counter()
    publish(v1, cfg, full_root, 1, args.formats, keep_last=None, report=full_report)
    full_s = time.perf_counter() - t0
    delta_report: dict = {}
    t0 = time.perf_counter()
    publish(v1, cfg, delta_root, 1, args.formats, delta=True, keep_last=None, report=delta_report)
    delta_s = time.perf_counter() - t0
    del v1  # the sampler side below needs only the stores: less memory pressure on its page cache
    store = open_store(delta_root)
    s3_stores = upload_to_s3(delta_root, full_root) if args.s3 else None
    results = {}
    for fmt in args.formats:
        v0_dir = work / "held" / fmt
        materialize(store, 0, fmt, v0_dir)  # what a sampler holds: v0, full
        full_dir = full_root / "v00000001" / fmt
        for p in full_dir.rglob("*"):  # warm the page cache for the baseline read
            if p.is_file():
                p.read_bytes()
        runs: dict[str, list[tuple[float, float]]] = {"read": [], "apply": [], "copy": []}
        if s3_stores:
            runs.update({"s3_fetch_full": [], "s3_fetch_delta_apply": []})
        for _ in range(args.repeats):  # interleaved, so load changes hit all alike
            t0, c0 = time.perf_counter(), cpu_seconds()
            assert check_manifest(full_dir) == []  # baseline: read + verify the full export
            runs["read"].append((time.perf_counter() - t0, cpu_seconds() - c0))
            applied = work / "applied" / fmt
            t0, c0 = time.perf_counter(), cpu_seconds()
            how = materialize(store, 1, fmt, applied, have=(0, v0_dir))
            runs["apply"].append((time.perf_counter() - t0, cpu_seconds() - c0))
            assert how == "v0 held + 1 delta(s)"
            shutil.rmtree(applied)
            t0, c0 = time.perf_counter(), cpu_seconds()
            shutil.copytree(full_dir, work / "copied" / fmt)
            runs["copy"].append((time.perf_counter() - t0, cpu_seconds() - c0))
            shutil.rmtree(work / "copied" / fmt)
            if s3_stores:  # a remote sampler: everything it reads comes through the S3 client
                for key, src, have, expect in (("s3_fetch_full", s3_stores["full"], None, "full snapshot v1"),
                                               ("s3_fetch_delta_apply", s3_stores["delta"], (0, v0_dir),
                                                "v0 held + 1 delta(s)")):
                    t0, c0 = time.perf_counter(), cpu_seconds()
                    how = materialize(src, 1, fmt, work / "fetched" / fmt, have=have)
                    runs[key].append((time.perf_counter() - t0, cpu_seconds() - c0))
                    assert how.startswith(expect), how
                    shutil.rmtree(work / "fetched" / fmt)
        stats = {k: _stats(v) for k, v in runs.items()}
        apply_s, read_s = stats["apply"]["wall_s"]["median"], stats["read"]["wall_s"]["median"]
        full_b, delta_b = full_report[fmt]["bytes"], delta_report[fmt]["bytes"]
        scale = QWEN3_30B_A3B_PARAMS / (info["params_m"] * 1e6)  # bytes per parameter kept
        bw = args.bandwidth_gbps * 1e9 / 8
        proj_full_b, proj_delta_b = full_b * scale, delta_b * scale
        apply_bps = full_b / apply_s  # full-directory bytes produced per second
        results[fmt] = {
            "full_bytes": full_b, "delta_bytes": delta_b, "delta_ratio": round(delta_b / full_b, 5),
            "target_ratio": TARGET.get(fmt), "meets_target": delta_b / full_b <= TARGET.get(fmt, 1),
            # medians of --repeats interleaved runs; min/median/max of each in "sampler"
            "sampler_apply_verify_s": round(apply_s, 3), "sampler_read_verify_full_s": round(read_s, 3),
            "apply_faster_than_full_read": apply_s < read_s,
            # CPU seconds (all threads): less sensitive to other jobs on the machine than wall
            "sampler_apply_verify_cpu_s": stats["apply"]["cpu_s"]["median"],
            "sampler_read_verify_full_cpu_s": stats["read"]["cpu_s"]["median"],
            "apply_cheaper_than_full_read_cpu":
                stats["apply"]["cpu_s"]["median"] < stats["read"]["cpu_s"]["median"],
            "sampler": {"apply_verify": stats["apply"], "read_verify_full": stats["read"],
                        "copy_full_no_hash": stats["copy"]},
            # at this bandwidth, fetch the full export + verify vs fetch the delta + apply + verify
            "sampler_total_s_at_bandwidth": {"full": round(full_b / bw + read_s, 3),
                                             "delta": round(delta_b / bw + apply_s, 3)},
            # the link speed below which fetching the delta and applying it wins (wall times;
            # None: the delta wins at any speed)
            "break_even_gbps": None if apply_s <= read_s
            else round((full_b - delta_b) * 8 / 1e9 / (apply_s - read_s), 2),
            **(_s3_summary(stats, full_b) if s3_stores else {}),
            "projection_qwen3_30b_a3b": {
                "full_gb": round(proj_full_b / 1e9, 2), "delta_gb": round(proj_delta_b / 1e9, 3),
                "full_transfer_s": round(proj_full_b / bw, 2),
                "delta_transfer_s": round(proj_delta_b / bw, 3),
                "delta_apply_verify_s_at_measured_rate": round(proj_full_b / apply_bps, 1),
            },
        }
        shutil.rmtree(v0_dir, ignore_errors=True)
    out = {
        "benchmark": "bench_weight_sync",
        "command": " ".join(["python", "benchmarks/bench_weight_sync.py", *sys.argv[1:]]),
        "model": {"shape": shape_of(args), **info},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
        "delta_version": DELTA_VERSION, "repeats": args.repeats,
        "publish_seconds": {"v0_full": round(v0_s, 2), "v1_full_baseline": round(full_s, 2),
                            "v1_delta": round(delta_s, 2)},
        "bandwidth_gbps": args.bandwidth_gbps,
        "miles_qwen3_30b_a3b_sync_s": MILES_S,
        "formats": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
