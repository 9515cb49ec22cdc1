"""The transport benchmark's smoke run: real processes, every submitted trajectory accepted once.

``benchmarks/bench_transport.py --quick`` (2 client processes, 4 timed trajectories per phase)
against a real ``mixrl-train serve``; the JSON must hold each phase's throughput, the CPU cost
per trajectory on both sides, and the server's count of accepted trajectories.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_transport_quick(tmp_path):
    out = tmp_path / "bench_transport.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transport.py"), "--quick",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    cfg = result["config"]
    assert cfg["clients"] == 2 and cfg["tokens"] == 4096 and cfg["head_k"] == 20
    # Each client: 2 warm-up trajectories per gRPC phase, then per_client x repeats in each.
    expected = cfg["clients"] * 2 * (2 + cfg["per_client"] * cfg["repeats"])
    assert result["server"] == {"accepted": expected, "rejected": 0}
    for phase in ("raw_socket", "grpc_opaque_bytes", "grpc_unary", "grpc_stream"):
        r = result[phase]
        assert r["trajectories"] == cfg["clients"] * cfg["per_client"]
        assert r["MB_per_s"] > 0
        cpu = r["median_cpu_ms_per_trajectory"]
        assert cpu["client_cpu_ms_per_trajectory"] > 0 and cpu["server_cpu_ms_per_trajectory"] >= 0
    assert 0 < result["ratio_stream"] < 2 and 0 < result["ratio_unary"] < 2
