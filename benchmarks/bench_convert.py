"""Export throughput per weight format vs a plain ``safetensors.torch.save_file``, in one run.

The same synthetic bf16 Qwen3 weights (held in memory, as the trainer holds them) are written

- by the baseline: ``safetensors.torch.save_file`` of the bf16 tensors (one file, no hashing,
  no conversion: page-cache write speed), and
- by ``convert.export.export_hf`` in each format: quantize + shard + index + config + sha256
  manifest + atomic rename, the full publish path of one format.

Each measurement runs in a fresh subprocess (so one run's freed heap cannot hide the next
one's peak) that builds the weights, warms up, then times one save. Throughput is source bf16
bytes per second; ``ratio`` is a format's throughput over the baseline's from the same run
(best of ``--repeats``, runs interleaved so load on the machine hits both alike). Peak RSS is
sampled from /proc every 5 ms during the timed save and reported above the RSS just before it
(the in-memory source weights excluded; freed heap reused from the weight generation can hide
part of a peak). CPU seconds (all threads) are reported beside wall time: on a shared machine
they show how much of the wall time was waiting for a core. Writes go to ``--dir`` (default:
tmpfs).

    .venv/bin/python benchmarks/bench_convert.py            # ~0.3 G params, ~1 min on 2 cores
    .venv/bin/python benchmarks/bench_convert.py --layers 2 --repeats 1   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from convert.export import export_hf
from convert.formats import FORMATS
from convert.formats.numerics import num_threads
from convert.qwen3_config import Qwen3Config, hf_tensor_shapes

RESULTS = Path(__file__).parent / "results" / "bench_convert.json"
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Peak resident set size above the starting RSS while the block runs."""

    def __enter__(self):
        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.delta_mb = (self.peak - self.start) / 2**20


def make_weights(cfg: Qwen3Config, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_tensor_shapes(cfg).items():
        w = rng.standard_normal(shape, dtype=np.float32)
        w *= 0.02
        out[name] = w.astype(ml_dtypes.bfloat16)
    return out


def baseline_save(weights: dict[str, np.ndarray], path: Path) -> None:
    import torch  # imported (and warmed up) before any timing, see main()
    from safetensors.torch import save_file

    # Zero-copy torch views of the same bf16 buffers: the baseline pays only for the write.
    tensors = {n: torch.frombuffer(a, dtype=torch.bfloat16).reshape(a.shape)
               for n, a in weights.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def _config(args) -> Qwen3Config:
    return Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                       num_attention_heads=max(1, args.hidden // 128),
                       num_key_value_heads=max(1, args.hidden // 512), head_dim=128,
                       tie_word_embeddings=False)


def child(args) -> None:
    """One timed save in this process; prints a JSON line."""
    import safetensors.torch  # noqa: F401  (imports outside the timing)
    import torch  # noqa: F401

    cfg = _config(args)
    weights = make_weights(cfg)
    work = Path(args.dir)
    out = work / f"{args.child}-{os.getpid()}"
    # Warm-up on a few small tensors: first-use costs of numpy, ml_dtypes, the thread pool.
    small = dict(list(weights.items())[-3:])
    baseline_save(small, work / f"warmup-{os.getpid()}.safetensors")
    (work / f"warmup-{os.getpid()}.safetensors").unlink()
    with PeakRSS() as rss:
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        if args.child == "baseline":
            baseline_save(weights, out)
        else:
            export_hf(iter(weights.items()), cfg.to_hf_dict(), out, args.child)
        dt = time.perf_counter() - t
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    size = out.stat().st_size if out.is_file() else sum(p.stat().st_size for p in out.iterdir())
    shutil.rmtree(out) if out.is_dir() else out.unlink()
    print(json.dumps({"seconds": dt, "cpu_seconds": cpu, "rss_mb": rss.delta_mb,
                      "out_bytes": size}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--formats", nargs="*", default=list(FORMATS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None,
                    help="where to write (default: a temp dir in /dev/shm, i.e. page-cache speed "
                         "without the VM disk's writeback throttling; else the system temp dir)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    cfg = _config(args)
    shapes = hf_tensor_shapes(cfg)
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    src_bytes = 2 * n_params
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_convert-", dir=shm))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{n_params / 1e6:.0f} M params, {src_bytes / 1e9:.2f} GB bf16, {len(shapes)} tensors, "
          f"{num_threads()} threads, writing to {work}")

    def measure(what: str) -> tuple[float, float, int]:
        cmd = [sys.executable, __file__, "--child", what, "--dir", str(work)] + [
            f"--{k}={getattr(args, k)}" for k in ("hidden", "intermediate", "layers", "vocab")]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode:
            raise RuntimeError(f"{what} failed:\n{proc.stderr}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"  {what:10s} {r['seconds']:6.2f} s  cpu {r['cpu_seconds']:6.2f} s  "
              f"{r['rss_mb']:6.0f} MB  (load {os.getloadavg()[0]:.1f})")
        return r["seconds"], r["rss_mb"], r["out_bytes"], r["cpu_seconds"]

    runs: dict[str, list] = {"baseline": []} | {f: [] for f in args.formats}
    for _ in range(args.repeats):
        for what in runs:
            runs[what].append(measure(what))
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)

    base_s = min(r[0] for r in runs["baseline"])
    base_cpu = min(r[3] for r in runs["baseline"])
    results = {}
    for what, rs in runs.items():
        best = min(rs, key=lambda r: r[0])
        results["baseline_safetensors_save" if what == "baseline" else what] = {
            "seconds": round(best[0], 3), "gb_per_s": round(src_bytes / best[0] / 1e9, 3),
            "m_params_per_s": round(n_params / best[0] / 1e6, 1),
            "ratio_vs_baseline": round(base_s / best[0], 3),
            "cpu_seconds": round(best[3], 3),
            "cpu_ratio_vs_baseline": round(base_cpu / min(r[3] for r in rs), 3),
            "output_gb": round(best[2] / 1e9, 3),
            "peak_rss_delta_mb": round(max(r[1] for r in rs), 1)}
    report = {
        "benchmark": "bench_convert",
        "command": "python benchmarks/bench_convert.py " + " ".join(
            f"--{k} {getattr(args, k)}" for k in ("hidden", "intermediate", "layers", "vocab",
                                                  "repeats")),
        "model": {"params_m": round(n_params / 1e6, 1), "bf16_gb": round(src_bytes / 1e9, 3),
                  "tensors": len(shapes), "hidden": args.hidden,
                  "intermediate": args.intermediate, "layers": args.layers, "vocab": args.vocab},
        "write_dir": str(work),
        "machine": {"cpus": os.cpu_count(), "threads": num_threads(),
                    "python": platform.python_version(), "numpy": np.__version__,
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'':12s} {'s':>7s} {'cpu s':>7s} {'GB/s':>7s} {'x base':>7s} {'RSS+ MB':>8s}")
    for name, r in results.items():
        print(f"{name[:12]:12s} {r['seconds']:7.2f} {r['cpu_seconds']:7.2f} {r['gb_per_s']:7.3f} "
              f"{r['ratio_vs_baseline']:7.3f} {r['peak_rss_delta_mb']:8.0f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
